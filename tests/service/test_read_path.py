"""The status-polling hot path, `GET /v1/fine_tuning/jobs/{id}`: an async route reading the API
key and the job in one statement on a bare connection (`service.db.session.read_first`), the
per-key rate limit awaited on the event loop (`service.ratelimit`), request metrics; on SQLite and
PostgreSQL."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Select, bindparam, event, literal_column, select, text, update

from service import auth, ratelimit
from service.db.models import Job
from service.db.pipelined_reads import close_read_pools
from service.db.session import get_engine, read_first, session_scope
from service.errors import RateLimitError
from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, LoraqEnv
from tests.servers import shared_redis_url
from tests.service.test_api_files import assert_error

ROUTE = "/v1/fine_tuning/jobs/{fine_tuning_job_id}"


def set_rate_limit(monkeypatch: pytest.MonkeyPatch, per_minute: int) -> float:
    """Set the limit; return a time 20 s into a window no other test used (`ratelimit.now`)."""
    monkeypatch.setenv("LORAQ_RATE_LIMIT_PER_MINUTE", str(per_minute))
    get_settings.cache_clear()
    monkeypatch.setattr(ratelimit, "_broken_until", 0.0)
    start = (int(time.time()) // 60 + 2) * 60 + 20.0
    monkeypatch.setattr(ratelimit, "now", lambda: start)
    return start


def test_read_first_runs_on_the_event_loop_and_a_server_read_does_not_block_it(loraq_env: LoraqEnv) -> None:
    server = not loraq_env.db_url.startswith("sqlite")
    # a slow server: the loop must keep serving other requests meanwhile
    stmt: Select[Any] = select(
        literal_column("pg_sleep(0.3)" if server else "1").label("slept"), bindparam("v").label("v")
    )

    async def main() -> tuple[Any, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        task = asyncio.create_task(ticker())
        try:
            row = await read_first(stmt, {"v": 7})
            again = await read_first(stmt, {"v": 8})  # the same (prepared) statement, a pooled connection
        finally:
            task.cancel()
            await close_read_pools()
        assert row is not None and again is not None
        return (row.v, again.v), ticks

    values, ticks = asyncio.run(main())
    assert values == (7, 8)
    if server:
        assert ticks >= 20, ticks  # the loop ran on during the two 0.3 s server-side sleeps


def test_status_read_is_the_job_object_and_commits_nothing(api: ApiClient) -> None:
    job = api.create_job(api.upload(DATASET))
    commits: list[object] = []

    def on_commit(conn: Any) -> None:
        commits.append(conn)

    engine = get_engine()
    event.listen(engine, "commit", on_commit)
    try:
        api.create_job(api.upload(DATASET))
        assert commits, "the listener sees the commits of a write"
        commits.clear()
        for _ in range(3):
            assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json() == job
        assert commits == []
    finally:
        event.remove(engine, "commit", on_commit)
    # tenant isolation and errors on the same path
    assert api.other is not None
    assert_error(api.other.get(f"/v1/fine_tuning/jobs/{job['id']}"), 404, "fine_tuning_job_id")
    assert_error(api.get("/v1/fine_tuning/jobs/ftjob-nope"), 404, "fine_tuning_job_id")


def test_status_read_refuses_a_revoked_key_at_once(api: ApiClient) -> None:
    job = api.create_job(api.upload(DATASET))
    url = f"/v1/fine_tuning/jobs/{job['id']}"
    assert api.get(url).status_code == 200
    with session_scope() as s:
        auth.revoke_key(s, api.key[: auth.PREFIX_CHARS])
    r = api.get(url)
    assert assert_error(r, 401)["code"] == "revoked_api_key"
    assert r.headers["www-authenticate"] == "Bearer"


def test_status_read_is_one_statement_for_the_key_and_the_job(api: ApiClient, loraq_env: LoraqEnv) -> None:
    """The key and the job are read together; the key is still checked before the job is shown,
    so a bad or revoked key is 401 whether or not the job exists, and never 404."""
    job = api.create_job(api.upload(DATASET))
    url = f"/v1/fine_tuning/jobs/{job['id']}"
    if loraq_env.db_url.startswith("sqlite"):  # PostgreSQL reads bypass SQLAlchemy (psycopg async)
        # SQLite reads run on the pool's DBAPI connections, below SQLAlchemy's events: sqlite3
        # traces each statement of the connections opened from here on.
        selects: list[str] = []

        def on_statement(statement: str) -> None:
            if statement.lstrip().upper().startswith("SELECT"):
                selects.append(statement)

        def on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.set_trace_callback(on_statement)

        engine = get_engine()
        engine.dispose()
        event.listen(engine, "connect", on_connect)
        try:
            assert api.get(url).json() == job
        finally:
            event.remove(engine, "connect", on_connect)
            engine.dispose()
        assert len(selects) == 1, selects
    wrong = {"Authorization": "Bearer sk-lq-wrong"}
    for path in (url, "/v1/fine_tuning/jobs/ftjob-nope", "/v1/fine_tuning/jobs/not%00an-id"):
        assert_error(api.client.get(path, headers=wrong), 401)
    assert_error(api.get("/v1/fine_tuning/jobs/not%00an-id"), 404, "fine_tuning_job_id")
    with session_scope() as s:
        auth.revoke_key(s, api.key[: auth.PREFIX_CHARS])
    for path in (url, "/v1/fine_tuning/jobs/ftjob-nope"):
        assert assert_error(api.get(path), 401)["code"] == "revoked_api_key"


def test_status_read_is_rate_limited_and_counted(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    job = api.create_job(api.upload(DATASET))
    url = f"/v1/fine_tuning/jobs/{job['id']}"
    set_rate_limit(monkeypatch, 2)
    assert api.get(url).status_code == 200
    assert api.get(url).status_code == 200
    r = api.get(url)
    assert assert_error(r, 429)["code"] == "rate_limit_exceeded"
    assert r.headers["Retry-After"] == "40"
    assert api.client.get(url, headers={"Authorization": "Bearer sk-lq-wrong"}).status_code == 401

    samples = {
        (s.labels.get("route"), s.labels.get("status")): s.value
        for fam in text_string_to_metric_families(api.scrape_metrics())
        for s in fam.samples
        if s.name == "loraq_http_requests_total" and s.labels.get("method") == "GET"
    }
    assert samples[(ROUTE, "200")] == 2
    assert samples[(ROUTE, "429")] == 1
    assert samples[(ROUTE, "401")] == 1


def test_rate_limit_counts_across_event_loops(loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each event loop gets its own asyncio Redis client (a connection cannot move between
    loops); the count is Redis's, so it carries across them; the counter expires."""
    start = set_rate_limit(monkeypatch, 2)
    key_id = f"test-loops-{loraq_env.queue}"
    asyncio.run(ratelimit.check_rate(key_id))
    asyncio.run(ratelimit.check_rate(key_id))
    with pytest.raises(RateLimitError) as refused:
        asyncio.run(ratelimit.check_rate(key_id))
    assert refused.value.headers == {"Retry-After": "40"}
    assert_counted(key_id, start, 3)
    assert ratelimit._broken_until == 0.0  # no Redis error on the way


def test_status_read_route_answers_as_the_fastapi_route(api: ApiClient) -> None:
    """GETs of the path are served by a plain route ahead of the FastAPI one: the query guard,
    error bodies, other methods and the metrics label stay what the FastAPI route gave."""
    job = api.create_job(api.upload(DATASET))
    url = f"/v1/fine_tuning/jobs/{job['id']}"
    err = assert_error(api.get(url + "?after=%00"), 400, "after")
    assert err["code"] == "invalid_query"
    for method in ("POST", "HEAD", "DELETE"):
        r = api.request(method, url)
        assert r.status_code == 405, (method, r.status_code)
        assert r.headers["allow"] == "GET"
    assert_error(api.client.get(url), 401)  # no key
    samples = {
        (s.labels.get("method"), s.labels.get("status")): s.value
        for fam in text_string_to_metric_families(api.scrape_metrics())
        for s in fam.samples
        if s.name == "loraq_http_requests_total" and s.labels.get("route") == ROUTE
    }
    assert samples[("GET", "400")] == 1 and samples[("GET", "401")] == 1 and samples[("POST", "405")] == 1


def test_status_read_shows_every_change_of_the_job(api: ApiClient) -> None:
    """The body is cached under the job's column values: any change is read at once."""
    job = api.create_job(api.upload(DATASET))
    url = f"/v1/fine_tuning/jobs/{job['id']}"
    assert api.get(url).json() == api.get(url).json() == job
    with session_scope() as s:
        s.execute(update(Job).where(Job.id == job["id"]).values(train_loss=1.25, metadata_={"a": "b"}))
    changed = api.get(url).json()
    assert changed["progress"]["train_loss"] == 1.25 and changed["metadata"] == {"a": "b"}
    cancelled = api.post(url + "/cancel").json()
    assert api.get(url).json() == cancelled and cancelled["status"] == "cancelled"


def test_concurrent_requests_are_counted_one_by_one(
    loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests that reach the limiter together share one round trip, and each is counted: with
    a limit of 3, three of five concurrent requests pass; the counter says 5 and expires."""
    start = set_rate_limit(monkeypatch, 3)
    key_id = f"test-batch-{loraq_env.queue}"

    async def five() -> list[BaseException | None]:
        return await asyncio.gather(*(ratelimit.check_rate(key_id) for _ in range(5)), return_exceptions=True)

    outcomes = asyncio.run(five())
    assert outcomes.count(None) == 3
    assert [type(o) for o in outcomes if o is not None] == [RateLimitError, RateLimitError]
    assert_counted(key_id, start, 5)


def test_a_failed_read_fails_alone_and_a_lost_connection_is_replaced(loraq_env: LoraqEnv) -> None:
    """PostgreSQL's reads share a pipelined connection: a read that fails does not fail the
    others sent with it, and a connection the server ends is replaced by the next read."""
    if loraq_env.db_url.startswith("sqlite"):
        pytest.skip("SQLite reads run inline, one at a time")
    import psycopg

    value: Select[Any] = select(bindparam("v").label("v"))
    failing: Select[Any] = select((literal_column("1") / bindparam("zero")).label("q"))
    unpreparable: Select[Any] = select(literal_column("no_such_column").label("x"))
    backend: Select[Any] = select(literal_column("pg_backend_pid()").label("pid"))

    async def main() -> None:
        try:
            outcomes: list[Any] = await asyncio.gather(
                read_first(value, {"v": 1}),
                read_first(failing, {"zero": 0}),
                read_first(value, {"v": 2}),
                read_first(value, {"v": "a\x00b"}),  # PostgreSQL's text cannot hold it
                read_first(unpreparable, {}),
                return_exceptions=True,
            )
            assert [o.v for o in (outcomes[0], outcomes[2])] == [1, 2]
            assert isinstance(outcomes[1], psycopg.errors.DivisionByZero)
            assert isinstance(outcomes[3], psycopg.DataError)
            assert isinstance(outcomes[4], psycopg.errors.UndefinedColumn)
            first: Any = await read_first(backend, {})
            with session_scope() as s:
                s.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first.pid})
            await asyncio.sleep(0.3)  # the reader sees the connection end
            again: Any = await read_first(backend, {})
            assert again.pid != first.pid
            last: Any = await read_first(value, {"v": 3})
            assert last.v == 3
        finally:
            await close_read_pools()

    asyncio.run(main())


@pytest.mark.serial  # a 100 ms bound on this process's event loop: alone on the machine
def test_a_silent_redis_lets_concurrent_requests_through_in_bounded_time(
    loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Redis that accepts connections and never answers (frozen): the requests waiting on the
    stuck round trip and those queued behind it all go through when it times out, together."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # the kernel completes connections; nothing ever answers
        set_rate_limit(monkeypatch, 1)
        monkeypatch.setenv("LORAQ_REDIS_URL", f"redis://127.0.0.1:{silent.getsockname()[1]}/0")
        get_settings.cache_clear()

        async def main() -> tuple[list[BaseException | None], float]:
            stuck = asyncio.gather(
                *(ratelimit.check_rate("silent") for _ in range(5)), return_exceptions=True
            )
            await asyncio.sleep(0.05)  # the first round trip is under way; these queue behind it
            behind = asyncio.gather(
                *(ratelimit.check_rate("silent") for _ in range(5)), return_exceptions=True
            )
            first = await stuck
            t_first = time.monotonic()
            rest = await behind
            return [*first, *rest], time.monotonic() - t_first

        t0 = time.monotonic()
        outcomes, lag = asyncio.run(main())
        elapsed = time.monotonic() - t0
    assert outcomes == [None] * 10  # failed open, none refused
    assert elapsed < 2 * ratelimit.REDIS_TIMEOUT_S + 0.5, elapsed
    assert lag < 0.1, lag  # the queued ones did not wait for a round trip of their own
    assert ratelimit._broken_until > 0


def assert_counted(key_id: str, start: float, count: int) -> None:
    """The key's rate-limit counter of the window holding `start` in Redis holds `count` and
    expires with the window (then it is deleted)."""
    counter = f"loraq:rl:{key_id}:{int(start // ratelimit.WINDOW_SECONDS)}"
    r = redis.Redis.from_url(shared_redis_url())
    try:
        assert int(r.get(counter) or 0) == count
        assert 0 < r.ttl(counter) <= ratelimit.WINDOW_SECONDS + 5
        r.delete(counter)
    finally:
        r.close()
