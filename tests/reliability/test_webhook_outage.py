"""Webhooks through the whole stack, with the API killed mid-delivery: a job submitted over the
API and trained by a real Celery worker ends `succeeded`; the event its end wrote (the outbox) is
sent by the API process to a real receiver process, which processes it and hangs before answering;
the API is SIGKILLed while the request is in flight (its sender holds the delivery's lease). The
receiver is restarted, the API too: once the dead sender's lease expires, the new API sends the
event again with the same `webhook-id`, and the receiver acknowledges it without processing it
twice."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.procs import ROOT, stop_process, wait_for
from tests.live_server import free_port
from tests.reliability.conftest import running_stack
from tests.servers import api_ready
from tests.service.test_webhook_delivery import receiver
from tests.webhook_receiver import read_jsonl

TIMEOUT_S = 2  # the sender's request timeout: the lease lasts this + LEASE_MARGIN_S


@pytest.mark.slow
def test_the_api_killed_mid_delivery_sends_the_event_again_and_it_is_processed_once(tmp_path: Path) -> None:
    from service.webhook_delivery import LEASE_MARGIN_S

    with running_stack(
        tmp_path,
        LORAQ_WEBHOOK_ALLOW_HTTP="1",
        LORAQ_WEBHOOK_ALLOW_HOSTS='["127.0.0.1"]',
        LORAQ_WEBHOOK_INTERVAL_SECONDS="0.2",
        LORAQ_WEBHOOK_TIMEOUT_SECONDS=str(TIMEOUT_S),
        LORAQ_WEBHOOK_RETRY_DELAYS_SECONDS="[0.5]",
    ) as stack:
        port = free_port()
        with stack.client() as c:
            r = c.post("/webhook_endpoints", json={"url": f"http://127.0.0.1:{port}/hook"})
            assert r.status_code == 200, r.text
            endpoint = r.json()
        stack.start_worker()
        received, processed = tmp_path / "received.jsonl", tmp_path / "processed.jsonl"
        with receiver(port, endpoint["secret"], tmp_path, "--hang-after-processing") as hanging:
            job_id = stack.submit(n_epochs=1)
            stack.wait(job_id, {"succeeded"}, timeout=240)
            wait_for(lambda: bool(read_jsonl(processed)), "the receiver processed the event", 30, hanging)
            assert stack.api is not None
            stop_process(stack.api, signal.SIGKILL)  # the sender dies holding the lease
            killed_at = time.monotonic()
        with receiver(port, endpoint["secret"], tmp_path):
            stack.api = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
                 "--host", "127.0.0.1", "--port", stack.url.rsplit(":", 1)[1], "--no-access-log"],
                env=stack.env, cwd=ROOT, stdout=(tmp_path / "api2.log").open("wb"),
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            wait_for(lambda: api_ready(stack.url), "API restarted", 60, stack.api)
            with stack.client() as c:

                def delivered() -> bool:
                    data = c.get(f"/webhook_endpoints/{endpoint['id']}/deliveries").json()["data"]
                    return bool(data) and data[0]["state"] == "delivered"

                wait_for(delivered, "the event sent again and delivered", 60, stack.api)
                redelivered_after = time.monotonic() - killed_at
                (delivery,) = c.get(f"/webhook_endpoints/{endpoint['id']}/deliveries").json()["data"]

    assert delivery["job_id"] == job_id and delivery["event_type"] == "fine_tuning.job.succeeded"
    arrivals = read_jsonl(received)
    assert [a["webhook_id"] for a in arrivals] == [delivery["id"]] * 2
    assert [a["duplicate"] for a in arrivals] == [False, True] and all(a["verified"] for a in arrivals)
    assert [p["webhook_id"] for p in read_jsonl(processed)] == [delivery["id"]]
    # attempt 1's sender died before writing its result: only the attempt that answered is listed
    assert [(a["attempt"], a["status_code"]) for a in delivery["attempts"]] == [(2, 200)]
    assert redelivered_after >= TIMEOUT_S + LEASE_MARGIN_S - 5  # not before the lease expired
