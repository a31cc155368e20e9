"""`/v1/webhook_endpoints`: register, list, retrieve and delete the HTTPS endpoints that receive
the tenant's job status events, and list an endpoint's deliveries (service/webhooks.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from service import webhooks
from service.auth import CurrentTenant
from service.db.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from service.db.session import SessionDep
from service.schemas import DATABASE_UNAVAILABLE, DISK_FULL, error_responses
from service.webhook_schemas import (
    WebhookAttemptPublic,
    WebhookDeliveriesPublic,
    WebhookDeliveryPublic,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointPublic,
    WebhookEndpointsPublic,
)
from service.webhook_urls import check_endpoint_url

router = APIRouter(
    prefix="/v1/webhook_endpoints",
    tags=["webhooks"],
    responses={**error_responses(400, 401, 404, 429, 500), **DATABASE_UNAVAILABLE},
)

MAX_DELIVERIES = 1000


def endpoint_public(endpoint: WebhookEndpoint, *, secret: str | None = None) -> WebhookEndpointPublic:
    return WebhookEndpointPublic.model_validate(endpoint).model_copy(update={"secret": secret})


def delivery_public(
    delivery: WebhookDelivery, endpoint: WebhookEndpoint, attempts: list[WebhookAttempt]
) -> WebhookDeliveryPublic:
    return WebhookDeliveryPublic(
        id=delivery.id,
        event_id=delivery.event_id,
        event_type=delivery.event_type,
        job_id=delivery.job_id,
        endpoint_id=endpoint.id,
        url=endpoint.url,
        created_at=delivery.created_at,
        state=delivery.state,
        next_attempt_at=delivery.next_attempt_at if delivery.state == "pending" else None,
        finished_at=delivery.finished_at,
        attempts=[WebhookAttemptPublic.model_validate(a) for a in attempts],
    )


@router.post("", response_model=WebhookEndpointPublic, responses=DISK_FULL)
def create_endpoint(
    body: WebhookEndpointCreate, request: Request, tenant: CurrentTenant, session: SessionDep
) -> WebhookEndpointPublic:
    """The answer holds the endpoint's signing secret (`whsec_…`), shown this once."""
    api_hosts = frozenset(h for h in (request.url.hostname,) if h)
    url = check_endpoint_url(body.url, api_hosts=api_hosts)
    events: list[str] = list(body.events or webhooks.EVENT_TYPES.values())
    endpoint = webhooks.create_endpoint(
        session, tenant_id=tenant.id, url=url, description=body.description, events=events
    )
    return endpoint_public(endpoint, secret=endpoint.secret)


@router.get("", response_model=WebhookEndpointsPublic)
def list_endpoints(tenant: CurrentTenant, session: SessionDep) -> WebhookEndpointsPublic:
    rows = webhooks.list_endpoints(session, tenant_id=tenant.id)
    return WebhookEndpointsPublic(data=[endpoint_public(e) for e in rows])


@router.get("/{endpoint_id}", response_model=WebhookEndpointPublic)
def retrieve_endpoint(endpoint_id: str, tenant: CurrentTenant, session: SessionDep) -> WebhookEndpointPublic:
    return endpoint_public(webhooks.get_endpoint(session, tenant_id=tenant.id, endpoint_id=endpoint_id))


@router.delete("/{endpoint_id}", response_model=WebhookEndpointDeleted, responses=DISK_FULL)
def delete_endpoint(endpoint_id: str, tenant: CurrentTenant, session: SessionDep) -> WebhookEndpointDeleted:
    webhooks.delete_endpoint(session, tenant_id=tenant.id, endpoint_id=endpoint_id)
    return WebhookEndpointDeleted(id=endpoint_id)


@router.get("/{endpoint_id}/deliveries", response_model=WebhookDeliveriesPublic)
def list_deliveries(
    endpoint_id: str,
    tenant: CurrentTenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1, le=MAX_DELIVERIES)] = 100,
) -> WebhookDeliveriesPublic:
    """Newest first, each with its attempts (status code or error, duration)."""
    webhooks.get_endpoint(session, tenant_id=tenant.id, endpoint_id=endpoint_id)
    rows = webhooks.deliveries(session, tenant_id=tenant.id, endpoint_id=endpoint_id, limit=limit)
    return WebhookDeliveriesPublic(data=[delivery_public(*row) for row in rows])
