"""The webhook sender: a loop in the API process (`WebhookThread`, every
`webhook_interval_seconds`) that sends the due rows of the `webhook_deliveries` outbox.

A tick claims up to `webhook_concurrency` due deliveries, each with one conditional UPDATE that
leases it (`lease_token`, `lease_until` = now + the request timeout + a margin) and counts the
attempt, so several API processes never send one row at once. It sends them side by side, then
writes each result back fenced on its lease token, with one `webhook_attempts` row per request.
A sender that dies mid-request leaves its lease to expire; the next tick sends the row again
with the same `webhook-id`, which the receiver uses to process it exactly once.

Outcomes (Standard Webhooks' rules): 2xx delivered; 410 Gone disables the endpoint (its pending
deliveries end `failed`); anything else (another status, a 3xx — redirects are not followed —, a
timeout, a refused connection, a URL the policy refuses now) is retried after
`webhook_retry_delays_seconds[attempt - 1]` (the last delay repeats; ±10 % jitter; at least a
`Retry-After` the receiver sent), never past `webhook_retry_window_seconds` after the event: one
last attempt at the window's end, then `failed`.
"""

from __future__ import annotations

import random
import secrets
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache

import httpx
from sqlalchemy import ColumnElement, or_, select, update
from sqlalchemy.orm import Session

from service.db.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint, now_s
from service.db.session import session_scope
from service.periodic import PeriodicThread
from service.settings import get_settings
from service.webhook_urls import UrlRefused, resolve_target
from service.webhooks import signed_headers

LEASE_MARGIN_S = 10.0  # beyond the request timeout: time to write the result back (else: sent again)
MAX_ERROR_CHARS = 500
MAX_RETRY_AFTER_S = 6 * 3600.0
JITTER = 0.1
USER_AGENT = "Loraq-Webhooks/1"


@dataclass(frozen=True)
class Due:
    """A leased delivery, with what sending it needs."""

    id: str
    attempt: int
    lease_token: str
    created_at: int
    body: str
    endpoint_id: str | None
    url: str | None  # None: nothing to send to any more (`gone` says why)
    secret: str | None
    gone: str | None = None


@dataclass(frozen=True)
class Outcome:
    started_at: float
    duration_ms: float
    status_code: int | None
    error: str | None
    retry_after: float | None = None

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


def next_attempt_at(
    *, created_at: float, attempt: int, now: float, retry_after: float | None = None, jitter: float = JITTER
) -> float | None:
    """When to try again after attempt number `attempt` (1, 2, ...) failed at `now`, or None once
    the retry window (counted from the event's `created_at`) has passed."""
    settings = get_settings()
    deadline = created_at + settings.webhook_retry_window_seconds
    if now >= deadline:
        return None
    delays = settings.webhook_retry_delays_seconds
    delay = delays[min(attempt, len(delays)) - 1] * random.uniform(1 - jitter, 1 + jitter)
    if retry_after is not None:
        delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
    return min(now + delay, deadline)


# ---------------------------------------------------------------- claim


def _claimable(now: float) -> list[ColumnElement[bool]]:
    return [
        WebhookDelivery.state == "pending",
        WebhookDelivery.next_attempt_at <= now,
        or_(WebhookDelivery.lease_until.is_(None), WebhookDelivery.lease_until < now),
    ]


def claim_due(session: Session, *, now: float, limit: int) -> list[Due]:
    """Lease up to `limit` due deliveries (oldest due first) for this sender."""
    lease_until = now + get_settings().webhook_timeout_seconds + LEASE_MARGIN_S
    ids = session.scalars(
        select(WebhookDelivery.id)
        .where(*_claimable(now))
        .order_by(WebhookDelivery.next_attempt_at)
        .limit(limit)
    ).all()
    claimed: list[Due] = []
    for delivery_id in ids:
        token = secrets.token_hex(16)
        stmt = (
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, *_claimable(now))
            .values(lease_until=lease_until, lease_token=token, attempts=WebhookDelivery.attempts + 1)
            .execution_options(synchronize_session=False)
        )
        if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
            continue  # another sender took it
        row = session.execute(
            select(WebhookDelivery, WebhookEndpoint)
            .outerjoin(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
            .where(WebhookDelivery.id == delivery_id)
            .execution_options(populate_existing=True)
        ).one()
        claimed.append(_due(row[0], row[1], token))
    return claimed


def _due(delivery: WebhookDelivery, endpoint: WebhookEndpoint | None, token: str) -> Due:
    settings = get_settings()
    url, secret, gone = None, None, None
    if delivery.endpoint_id is None:
        url, secret = settings.webhook_operator_url, settings.webhook_operator_secret
        if not url or not secret:
            gone = "the operator's endpoint is no longer configured (LORAQ_WEBHOOK_OPERATOR_URL, _SECRET)"
    elif endpoint is None or endpoint.deleted_at is not None:
        gone = "the endpoint was deleted"
    elif endpoint.disabled_at is not None:
        gone = f"the endpoint is disabled: {endpoint.disabled_reason}"
    else:
        url, secret = endpoint.url, endpoint.secret
    return Due(
        id=delivery.id,
        attempt=delivery.attempts,
        lease_token=token,
        created_at=delivery.created_at,
        body=delivery.body,
        endpoint_id=delivery.endpoint_id,
        url=url if gone is None else None,
        secret=secret if gone is None else None,
        gone=gone,
    )


# ---------------------------------------------------------------- send


@lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    """The system's trust store (and SSL_CERT_FILE) plus certifi's."""
    import certifi

    context = ssl.create_default_context()
    context.load_verify_locations(certifi.where())
    return context


def send(due: Due) -> Outcome:
    """One POST of the delivery's body, signed now, to the address its host resolves to now (the
    URL policy checked on it), naming the host in Host and TLS SNI; never raises."""
    started = time.time()
    t0 = time.perf_counter()

    def outcome(status: int | None, error: str | None, retry_after: float | None = None) -> Outcome:
        ms = (time.perf_counter() - t0) * 1000
        return Outcome(started, ms, status, error and error[:MAX_ERROR_CHARS], retry_after)

    if due.url is None or due.secret is None:
        return outcome(None, due.gone or "nothing to send to")
    try:
        target = resolve_target(due.url)
        headers = signed_headers(due.secret, msg_id=due.id, body=due.body)
    except UrlRefused as e:
        return outcome(None, f"the URL is refused now: {e}")
    except ValueError as e:  # a malformed operator secret
        return outcome(None, f"cannot sign: {e}")
    address = f"[{target.address}]" if ":" in target.address else target.address
    default_port = 443 if target.scheme == "https" else 80
    named = f"[{target.host}]" if ":" in target.host else target.host  # an IPv6 literal
    host = named if target.port == default_port else f"{named}:{target.port}"
    settings = get_settings()
    client = httpx.Client(
        timeout=settings.webhook_timeout_seconds,
        follow_redirects=False,
        trust_env=False,  # no proxy from the environment: we connect to the address we checked
        verify=_tls(),
    )
    try:
        # streamed and closed unread: only the status and headers count, and a receiver's endless
        # body costs no memory
        with (
            client,
            client.stream(
                "POST",
                f"{target.scheme}://{address}:{target.port}{target.path}",
                content=due.body.encode(),
                headers={**headers, "host": host, "user-agent": USER_AGENT},
                extensions={"sni_hostname": target.host} if target.scheme == "https" else {},
            ) as response,
        ):
            status, retry_after = response.status_code, response.headers.get("retry-after")
    except httpx.HTTPError as e:
        return outcome(None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return outcome(status, None if 200 <= status < 300 else f"HTTP {status}", _retry_after(retry_after))


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the schedule's delay stands


# ---------------------------------------------------------------- record


def record(session: Session, *, due: Due, outcome: Outcome, now: float) -> str | None:
    """Write `outcome` back, fenced on the lease; the delivery's new state, or None if this
    sender no longer held it (its lease expired and another sender took it)."""
    values: dict[str, object] = {
        "lease_until": None,
        "lease_token": None,
        "last_status": outcome.status_code,
        "last_error": outcome.error,
    }
    retry_at = None
    if outcome.delivered:
        values.update(state="delivered", finished_at=now_s())
    elif outcome.status_code == 410 or due.gone is not None:
        values.update(state="failed", finished_at=now_s())
    else:
        retry_at = next_attempt_at(
            created_at=due.created_at, attempt=due.attempt, now=now, retry_after=outcome.retry_after
        )
        values.update(
            {"state": "failed", "finished_at": now_s()}
            if retry_at is None
            else {"state": "pending", "next_attempt_at": retry_at}
        )
    stmt = (
        update(WebhookDelivery)
        .where(
            WebhookDelivery.id == due.id,
            WebhookDelivery.state == "pending",
            WebhookDelivery.lease_token == due.lease_token,
        )
        .values(**values)
        .execution_options(synchronize_session=False)
    )
    if session.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        return None
    session.add(
        WebhookAttempt(
            delivery_id=due.id,
            attempt=due.attempt,
            started_at=outcome.started_at,
            duration_ms=outcome.duration_ms,
            status_code=outcome.status_code,
            error=outcome.error,
        )
    )
    if outcome.status_code == 410 and due.endpoint_id is not None:
        _disable(session, due.endpoint_id, "the receiver answered 410 Gone")
    session.flush()
    return str(values["state"])


def _disable(session: Session, endpoint_id: str, reason: str) -> None:
    session.execute(
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.disabled_at.is_(None))
        .values(disabled_at=now_s(), disabled_reason=reason)
    )
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.endpoint_id == endpoint_id, WebhookDelivery.state == "pending")
        .values(state="failed", last_error=f"the endpoint is disabled: {reason}", finished_at=now_s())
        .execution_options(synchronize_session=False)
    )


# ---------------------------------------------------------------- the loop


class Sender:
    """One tick at a time: claim what is due, send it side by side, record each result."""

    def __init__(self, send_one: Callable[[Due], Outcome] = send) -> None:
        self._send = send_one
        self._pool = ThreadPoolExecutor(max_workers=get_settings().webhook_concurrency)

    def tick(self, now: float | None = None) -> dict[str, str | None]:
        """{delivery id: its new state (None: fenced out)} for the deliveries this tick sent."""
        now = time.time() if now is None else now
        with session_scope() as session:
            due = claim_due(session, now=now, limit=get_settings().webhook_concurrency)
        outcomes = list(self._pool.map(self._send, due))
        states: dict[str, str | None] = {}
        for item, result in zip(due, outcomes, strict=True):
            with session_scope() as session:
                states[item.id] = record(session, due=item, outcome=result, now=time.time())
        return states

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class WebhookThread(PeriodicThread):
    """`Sender.tick` every `interval` seconds in a daemon thread until `stop()`."""

    def __init__(self, interval: float) -> None:
        self.sender = Sender()
        super().__init__("webhooks", interval, self.sender.tick)

    def stop(self) -> None:
        super().stop()
        self.sender.close()
