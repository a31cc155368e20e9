"""worker/consumer_watch.py: the rule that calls a consumer stuck (pure, on a clock of the test's
own), and a real `loraq worker` on a real Redis whose consumer cannot take messages: it stops
itself with exit code 75 (EX_TEMPFAIL: `loraq up` restarts it without counting a crash), leaving
the message queued for the next worker. (That a healthy worker is never stopped by the watch, and
takes what waits, tests/e2e/test_up_redis_outages.py shows over minutes of outages and jobs.)"""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.broker import RUN_JOB_TASK, kombu_queue_depth, make_celery
from service.dependency import EXIT_DEPENDENCY_DOWN
from service.redis_client import redis_client
from service.settings import Settings
from tests.e2e.procs import ROOT, clean_env, stop_process, wait_for
from tests.servers import shared_redis_url
from worker.consumer_watch import ConsumerWatch

STUCK_S = 3.0


def watch() -> ConsumerWatch:
    return ConsumerWatch(Settings(worker_stuck_seconds=STUCK_S))


def test_messages_waiting_untaken_while_idle_for_the_stuck_time_is_stuck() -> None:
    w = watch()
    assert not w.observe(2, now=100.0, busy=False) and w.waiting_since == 100.0
    assert not w.observe(2, now=102.9, busy=False)
    assert w.observe(1, now=103.0, busy=False)
    assert w.status()["consuming"] is False


def test_a_job_an_empty_queue_an_outage_or_a_taken_message_restarts_the_clock() -> None:
    w = watch()
    w.observe(1, now=0.0, busy=False)
    # a job runs (the solo pool runs it in the consumer: it takes nothing meanwhile)
    assert not w.observe(1, now=10.0, busy=True) and w.waiting_since is None
    for depth in (0, None):  # an empty queue; Redis not answering (an outage is not a dead consumer)
        w.observe(1, now=20.0, busy=False)
        assert not w.observe(depth, now=30.0, busy=False) and w.waiting_since is None
    w.observe(1, now=40.0, busy=False)
    w.last_received = 41.0  # the consumer took one: the others are still being taken
    assert not w.observe(1, now=43.5, busy=False) and w.waiting_since == 43.5
    assert not w.observe(1, now=46.4, busy=False)
    assert w.observe(1, now=46.5, busy=False)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    from service.db.migrate import upgrade_head

    db = f"sqlite:///{tmp_path / 'loraq.db'}"
    upgrade_head(db)
    return clean_env(
        LORAQ_REDIS_URL=shared_redis_url(),
        LORAQ_DATABASE_URL=db,
        LORAQ_DATA_DIR=str(tmp_path / "var"),
        LORAQ_WORKER_QUEUE=f"watch-{secrets.token_hex(4)}",
        LORAQ_WORKER_STUCK_SECONDS=str(STUCK_S),
        LORAQ_WORKER_METRICS_PORT="0",
    )


def test_a_stuck_consumer_stops_its_worker_with_75_leaving_the_message_queued(
    env: dict[str, str], tmp_path: Path
) -> None:
    settings = Settings(redis_url=env["LORAQ_REDIS_URL"], worker_queue=env["LORAQ_WORKER_QUEUE"])
    queue, client = settings.worker_queue, redis_client(settings)
    log = tmp_path / "jammed.log"
    jammed = subprocess.Popen(
        [sys.executable, "-m", "tests.worker.jammed_worker", "worker", "--queue", queue],
        env=env, cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: b" ready." in log.read_bytes(), "jammed worker", 120, jammed)
        make_celery(settings).send_task(RUN_JOB_TASK, args=["ftjob-none"], queue=queue)
        t0 = time.monotonic()
        rc = jammed.wait(timeout=STUCK_S + 30)
        text = log.read_text(errors="replace")
        assert rc == EXIT_DEPENDENCY_DOWN, text[-3000:]
        assert time.monotonic() - t0 < STUCK_S + 15, text[-3000:]
        said = f"while 1 waited in queue {queue} and no job ran: restarting this worker (exit code 75)"
        assert said in text, text[-3000:]
        assert "did not stop within" not in text  # a warm shutdown, not the forced exit
        assert kombu_queue_depth(client, queue) == 1  # untouched, for the next worker
    finally:
        stop_process(jammed)
        client.delete(queue)
        client.close()
