"""A job whose files take longer to count than a submit waits is accepted in `validating_files`
and counted by a process of its own (service/file_validation.py): then `queued`, or `failed` with
the error a submit answers once the counts exist. Real counting processes, Redis and databases;
`submit_count_seconds=0` makes the small files here "too large" to count at submit."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from service import file_validation
from service.db.session import session_scope
from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, job_body
from tests.servers import shared_redis_url

LONG = json.dumps(
    {
        "messages": [
            {"role": "user", "content": "tell"},
            {"role": "assistant", "content": "a long story " * 20},
        ]
    }
)
LONG_FILE = DATASET + (LONG + "\n").encode() * 2


@pytest.fixture
def count_in_background(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAQ_SUBMIT_COUNT_SECONDS", "0")
    get_settings.cache_clear()


def wait_status(api: ApiClient, job_id: str, leaves: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        job: dict[str, Any] = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
        if job["status"] != leaves or time.monotonic() > deadline:
            return job
        time.sleep(0.1)


def events(api: ApiClient, job_id: str) -> list[str]:
    data = api.get(f"/v1/fine_tuning/jobs/{job_id}/events", params={"limit": 100}).json()["data"]
    return [e["message"] for e in reversed(data)]


def queued_messages(queue: str, wait_for: int = 0) -> int:
    """Messages in the broker's list for `queue`, after waiting up to 10 s for `wait_for` of them
    (the counting process sends its wake-up just after it commits)."""
    client = redis.Redis.from_url(shared_redis_url())
    try:
        deadline = time.monotonic() + 10
        while (n := int(client.llen(queue))) < wait_for and time.monotonic() < deadline:
            time.sleep(0.05)
        return n
    finally:
        client.close()


@pytest.mark.usefixtures("count_in_background")
def test_too_long_examples_fail_the_waiting_job_with_the_submits_error(api: ApiClient) -> None:
    file_id = api.upload(LONG_FILE)
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, max_seq_len=64))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "validating_files"
    job = wait_status(api, r.json()["id"], "validating_files")
    assert job["status"] == "failed", job
    error = job["error"]
    assert error["code"] == "max_seq_len_too_short" and error["param"] == "max_seq_len"
    # the counts are stored now: the same submit is refused at once, with the same words
    again = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, max_seq_len=64))
    assert again.status_code == 400 and again.json()["error"]["message"] == error["message"]
    assert "2 of the 6 examples in training_file are longer than max_seq_len 64" in error["message"]
    assert events(api, job["id"])[-1] == error["message"]


@pytest.mark.usefixtures("count_in_background")
def test_a_job_whose_examples_fit_is_queued_and_sent_once_counted(api: ApiClient) -> None:
    queue = get_settings().worker_queue
    file_id = api.upload(LONG_FILE)
    r = api.post("/v1/fine_tuning/jobs", json=job_body(file_id, max_seq_len=512))
    assert r.json()["status"] == "validating_files" and queued_messages(queue) == 0
    job = wait_status(api, r.json()["id"], "validating_files")
    assert job["status"] == "queued" and job["error"] is None
    assert queued_messages(queue, wait_for=1) == 1  # the counting process sent its wake-up
    said = events(api, job["id"])
    assert said[:2] == [f"Validating training file: {file_id}", "Files validated, moving job to queued state"]
    # a second job on the same file is checked at submit from the stored counts
    assert (
        api.post("/v1/fine_tuning/jobs", json=job_body(file_id, max_seq_len=512)).json()["status"] == "queued"
    )


@pytest.mark.usefixtures("count_in_background")
def test_a_validation_file_too_large_to_count_keeps_the_job_waiting_too(api: ApiClient) -> None:
    body = job_body(api.upload(DATASET), validation_file=api.upload(LONG_FILE), max_seq_len=64)
    r = api.post("/v1/fine_tuning/jobs", json=body)
    assert r.json()["status"] == "validating_files"
    job = wait_status(api, r.json()["id"], "validating_files")
    assert job["status"] == "failed" and "examples in validation_file" in job["error"]["message"]


@pytest.mark.usefixtures("count_in_background")
def test_a_cancelled_waiting_job_stays_cancelled(api: ApiClient) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(api.upload(LONG_FILE), max_seq_len=512))
    job_id = r.json()["id"]
    assert api.post(f"/v1/fine_tuning/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    assert file_validation._children[job_id].wait(60) == 0  # it found the job no longer waiting
    assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "cancelled"
    assert "Files validated, moving job to queued state" not in events(api, job_id)


@pytest.mark.usefixtures("count_in_background")
def test_the_reaper_counts_for_a_waiting_job_that_nobody_counts(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = file_validation.start
    monkeypatch.setattr(file_validation, "start", lambda job_id: None)  # as if the API died right after
    job_id = api.post("/v1/fine_tuning/jobs", json=job_body(api.upload(LONG_FILE), max_seq_len=64)).json()[
        "id"
    ]
    monkeypatch.setattr(file_validation, "start", start)
    assert job_id not in file_validation.tick()  # too young: its own counter may still be starting
    assert job_id not in file_validation._children
    later = time.time() + file_validation.START_GRACE_S
    assert job_id not in file_validation.tick(later)  # no counts, no lock held: counting starts
    assert file_validation._children[job_id].wait(60) == 0
    job = api.get(f"/v1/fine_tuning/jobs/{job_id}").json()
    assert job["status"] == "failed" and job["error"]["code"] == "max_seq_len_too_short"


def test_repeated_lines_are_counted_once_and_kept_in_file_order(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service import files, token_lengths

    lines = [json.dumps({"text": word * (i + 1)}).encode() + b"\n" for i, word in enumerate("abcd")]
    a, b, c, d = lines
    file_id = api.upload(a + b + a + c + b"\n" + a + b + d)  # line 5 is blank
    with session_scope() as s:
        row = files.get_file(s, tenant_id=api.tenant_id, file_id=file_id)
    counter = token_lengths.counter_for("tiny-llama")
    assert counter is not None
    tokenized: list[int] = []
    count_all = counter.count_all

    def recording(items: list[tuple[str, dict[str, Any]]]) -> list[int | None]:
        tokenized.append(len(items))
        return count_all(items)

    monkeypatch.setattr(token_lengths, "BATCH_LINES", 3)  # a repeat in the batch after its first
    monkeypatch.setattr(type(counter), "count_all", lambda self, items: recording(items))
    found = token_lengths.count(row, counter)
    assert found is not None and list(found.lines) == [1, 2, 3, 4, 6, 7, 8]
    each = {raw: count_all([("text", json.loads(raw))])[0] for raw in lines}
    assert list(found.tokens) == [each[x] for x in (a, b, a, c, a, b, d)]
    assert tokenized == [3, 1, 1]  # a b a (a batch counts its own repeats) | c (a b seen) | d


@pytest.mark.usefixtures("count_in_background")
def test_a_count_that_never_finishes_leaves_the_check_to_the_worker(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    start = file_validation.start
    monkeypatch.setattr(file_validation, "start", lambda job_id: None)
    body = job_body(api.upload(LONG_FILE), max_seq_len=64)
    job_id = api.post("/v1/fine_tuning/jobs", json=body).json()["id"]
    monkeypatch.setattr(file_validation, "start", start)
    monkeypatch.setitem(file_validation._starts, job_id, file_validation.MAX_STARTS)  # all died
    assert job_id in file_validation.tick(time.time() + file_validation.START_GRACE_S)
    assert job_id not in file_validation._children  # not started a fourth time
    assert api.get(f"/v1/fine_tuning/jobs/{job_id}").json()["status"] == "queued"
    said = events(api, job_id)
    assert said[1].startswith("The token lengths of the job's files were not checked (its token count"), said
