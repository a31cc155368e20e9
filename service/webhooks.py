"""Webhooks: endpoints, the events a job's status change sends, and how they are signed.

A tenant registers endpoints (`POST /v1/webhook_endpoints`); the operator may add one for every
tenant (`LORAQ_WEBHOOK_OPERATOR_URL` + `_SECRET`). When a job ends, the transition in
service/jobs.py calls `job_ended` in its own transaction, which writes one `webhook_deliveries`
row per endpoint that wants the event (the outbox: the event exists exactly when the status
change committed, whatever dies afterwards). service/webhook_delivery.py sends the rows.

Events are OpenAI's fine-tuning webhook events, with their payload:

    {"id": "evt_…", "type": "fine_tuning.job.succeeded", "created_at": 1700000000,
     "object": "event", "data": {"id": "ftjob-…"}}

signed as Standard Webhooks specifies (what OpenAI's `client.webhooks.unwrap` verifies):

    webhook-id: wh_…                       the same on every retry: the receiver's idempotency key
    webhook-timestamp: <unix seconds>      of this attempt
    webhook-signature: v1,<base64(HMAC-SHA256(key, f"{webhook-id}.{timestamp}.{body}"))>

where the endpoint's secret is shown once as `whsec_<base64(key)>` (32 random bytes).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from service.db.models import Job, WebhookAttempt, WebhookDelivery, WebhookEndpoint, is_id, now_s
from service.errors import InvalidRequestError, NotFoundError
from service.settings import get_settings

# A job's terminal status -> OpenAI's webhook event type (OpenAI sends no event for the others).
EVENT_TYPES = {
    "succeeded": "fine_tuning.job.succeeded",
    "failed": "fine_tuning.job.failed",
    "cancelled": "fine_tuning.job.cancelled",
}
SECRET_PREFIX = "whsec_"
SECRET_BYTES = 32  # Standard Webhooks: 24 to 64 random bytes


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_` secret (ValueError for anything else)."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError(f"a webhook secret starts with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except binascii.Error as e:
        raise ValueError(f"a webhook secret is {SECRET_PREFIX!r} + base64 ({e})") from None
    if not 24 <= len(key) <= 64:
        raise ValueError("a webhook secret holds 24 to 64 bytes")
    return key


def signature(secret: str, *, msg_id: str, timestamp: int, body: str) -> str:
    """The `webhook-signature` header value for one attempt."""
    signed = f"{msg_id}.{timestamp}.{body}".encode()
    digest = hmac.new(secret_key(secret), signed, hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def signed_headers(secret: str, *, msg_id: str, body: str, timestamp: int | None = None) -> dict[str, str]:
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(ts),
        "webhook-signature": signature(secret, msg_id=msg_id, timestamp=ts, body=body),
        "content-type": "application/json",
    }


def event_body(*, event_id: str, event_type: str, created_at: int, job_id: str) -> str:
    """OpenAI's event payload, serialised once: these exact characters are signed and sent."""
    event = {
        "id": event_id,
        "type": event_type,
        "created_at": created_at,
        "object": "event",
        "data": {"id": job_id},
    }
    return json.dumps(event, separators=(",", ":"))


# ---------------------------------------------------------------- the outbox


def job_ended(session: Session, *, job_id: str, status: str) -> list[str]:
    """Write the deliveries of job `job_id`'s end (`status`) for each endpoint that wants it, in the
    caller's transaction (call it right after the transition's UPDATE succeeded). Their ids."""
    event_type = EVENT_TYPES.get(status)
    if event_type is None:
        return []
    tenant_id = session.scalar(select(Job.tenant_id).where(Job.id == job_id))
    if tenant_id is None:
        return []
    endpoints = session.execute(
        select(WebhookEndpoint.id, WebhookEndpoint.events).where(
            WebhookEndpoint.tenant_id == tenant_id,
            WebhookEndpoint.deleted_at.is_(None),
            WebhookEndpoint.disabled_at.is_(None),
        )
    ).all()
    targets: list[str | None] = [e.id for e in endpoints if event_type in e.events]
    if get_settings().webhook_operator_url:
        targets.append(None)
    if not targets:
        return []
    now = now_s()
    event_id = "evt_" + secrets.token_hex(16)
    body = event_body(event_id=event_id, event_type=event_type, created_at=now, job_id=job_id)
    rows = [
        WebhookDelivery(
            id="wh_" + secrets.token_hex(16),
            event_id=event_id,
            event_type=event_type,
            job_id=job_id,
            endpoint_id=endpoint_id,
            body=body,
            created_at=now,
            state="pending",
            attempts=0,
            next_attempt_at=time.time(),
        )
        for endpoint_id in targets
    ]
    session.add_all(rows)
    session.flush()
    return [r.id for r in rows]


# ---------------------------------------------------------------- endpoints


def create_endpoint(
    session: Session, *, tenant_id: str, url: str, description: str | None, events: list[str]
) -> WebhookEndpoint:
    """A new endpoint with a fresh secret (the caller checked `url` against the policy)."""
    limit = get_settings().webhook_max_endpoints_per_tenant
    count = session.scalar(
        select(func.count())
        .select_from(WebhookEndpoint)
        .where(WebhookEndpoint.tenant_id == tenant_id, WebhookEndpoint.deleted_at.is_(None))
    )
    if (count or 0) >= limit:
        raise InvalidRequestError(
            f"this organization already has {count} webhook endpoints, the limit "
            "(LORAQ_WEBHOOK_MAX_ENDPOINTS_PER_TENANT); delete one first",
            param="url",
            code="too_many_webhook_endpoints",
        )
    endpoint = WebhookEndpoint(
        tenant_id=tenant_id,
        url=url,
        description=description,
        events=sorted(set(events), key=list(EVENT_TYPES.values()).index),
        secret=new_secret(),
    )
    session.add(endpoint)
    session.flush()
    return endpoint


def list_endpoints(session: Session, *, tenant_id: str) -> list[WebhookEndpoint]:
    query = select(WebhookEndpoint).where(
        WebhookEndpoint.tenant_id == tenant_id, WebhookEndpoint.deleted_at.is_(None)
    )
    return list(session.scalars(query.order_by(WebhookEndpoint.seq)))


def get_endpoint(session: Session, *, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    """The tenant's endpoint, or 404 (also for another tenant's: existence is not revealed)."""
    endpoint = (
        session.scalar(
            select(WebhookEndpoint).where(
                WebhookEndpoint.id == endpoint_id,
                WebhookEndpoint.tenant_id == tenant_id,
                WebhookEndpoint.deleted_at.is_(None),
            )
        )
        if is_id(endpoint_id)
        else None
    )
    if endpoint is None:
        raise NotFoundError(f"No webhook endpoint found with id {endpoint_id!r}", param="endpoint_id")
    return endpoint


def delete_endpoint(session: Session, *, tenant_id: str, endpoint_id: str) -> WebhookEndpoint:
    """Stop sending to the endpoint: it is hidden and its pending deliveries end `failed`; the
    deliveries it had stay listed on their jobs."""
    endpoint = get_endpoint(session, tenant_id=tenant_id, endpoint_id=endpoint_id)
    endpoint.deleted_at = now_s()
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.endpoint_id == endpoint.id, WebhookDelivery.state == "pending")
        .values(state="failed", last_error="the endpoint was deleted", finished_at=now_s()),
        execution_options={"synchronize_session": False},
    )
    session.flush()
    return endpoint


# ---------------------------------------------------------------- reads of deliveries


def deliveries(
    session: Session, *, tenant_id: str, job_id: str | None = None, endpoint_id: str | None = None, limit: int
) -> list[tuple[WebhookDelivery, WebhookEndpoint, list[WebhookAttempt]]]:
    """The tenant's deliveries (newest first) of one job or one endpoint, with their endpoint and
    attempts (oldest first). The operator's endpoint's deliveries are not the tenant's to read."""
    query = (
        select(WebhookDelivery, WebhookEndpoint)
        .join(WebhookEndpoint, WebhookEndpoint.id == WebhookDelivery.endpoint_id)
        .where(WebhookEndpoint.tenant_id == tenant_id)
    )
    if job_id is not None:
        query = query.where(WebhookDelivery.job_id == job_id)
    if endpoint_id is not None:
        query = query.where(WebhookDelivery.endpoint_id == endpoint_id)
    rows = session.execute(query.order_by(WebhookDelivery.seq.desc()).limit(limit)).all()
    attempts: dict[str, list[WebhookAttempt]] = {row[0].id: [] for row in rows}
    if attempts:
        found = session.scalars(
            select(WebhookAttempt)
            .where(WebhookAttempt.delivery_id.in_(list(attempts)))
            .order_by(WebhookAttempt.attempt)
        )
        for attempt in found:
            attempts[attempt.delivery_id].append(attempt)
    return [(d, e, attempts[d.id]) for d, e in rows]
