"""Request and response models of `/v1/webhook_endpoints` (service/api/webhooks.py) and of the
deliveries the dashboard lists (a Loraq extension: OpenAI configures webhooks in its web console)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.schemas import Forbid

EventType = Literal["fine_tuning.job.succeeded", "fine_tuning.job.failed", "fine_tuning.job.cancelled"]


class WebhookEndpointCreate(Forbid):
    url: str = Field(min_length=1, max_length=2048)
    description: str | None = Field(None, max_length=512)
    # the event types to receive; default: all three
    events: list[EventType] | None = Field(None, min_length=1)


class WebhookEndpointPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # built from a `WebhookEndpoint` row

    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    url: str
    description: str | None
    events: list[EventType]
    created_at: int
    # set once the receiver answered 410 Gone: nothing is sent to it any more
    disabled_at: int | None
    disabled_reason: str | None
    # `whsec_…`: in the answer to the POST that created it, never again
    secret: str | None = None


class WebhookEndpointsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookEndpointPublic]
    has_more: bool = False


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookAttemptPublic(BaseModel):
    model_config = ConfigDict(from_attributes=True)  # built from a `WebhookAttempt` row

    attempt: int
    started_at: float
    duration_ms: float
    status_code: int | None  # null: no answer (`error` says why)
    error: str | None


class WebhookDeliveryPublic(BaseModel):
    id: str  # the `webhook-id` header, the same on every attempt
    object: Literal["webhook_delivery"] = "webhook_delivery"
    event_id: str
    event_type: EventType
    job_id: str
    endpoint_id: str
    url: str
    created_at: int
    state: Literal["pending", "delivered", "failed"]
    next_attempt_at: float | None  # pending only
    finished_at: int | None
    attempts: list[WebhookAttemptPublic]


class WebhookDeliveriesPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[WebhookDeliveryPublic]
