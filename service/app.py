"""The FastAPI application: `create_app()` (uvicorn: `service.app:create_app --factory`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi

from service import file_validation
from service.api import chat, files, health, jobs, models, webhooks
from service.api.dashboard import mount_dashboard
from service.api.docs import mount_docs
from service.api.metrics import install_service_metrics
from service.api.plain_route import install_plain_routes
from service.api.query_guard import refuse_nul_in_query
from service.api.security_headers import SecureHeadersApp
from service.db.pipelined_reads import close_read_pools
from service.errors import install_error_handlers
from service.settings import Settings, get_settings
from service.storage import default_store

PARTIAL_MAX_AGE_S = 3600.0

DESCRIPTION = (
    "Self-hostable LoRA fine-tuning, OpenAI-compatible under /v1. "
    "Authenticate with `Authorization: Bearer <API key>`."
)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app. Service modules read `get_settings()`; `settings` (default: the same
    object) decides what the app itself does at startup: migrations and CORS."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.migrate_on_start:
            from service.db.migrate import upgrade_head

            upgrade_head(settings.resolved_database_url)
        # Uploads cut off by a crash leave invisible temp files; an hour-old one is nobody's.
        default_store().sweep_partials(older_than_s=PARTIAL_MAX_AGE_S)
        # Re-queue jobs of silent workers; re-send queued jobs the broker lost (service/reaper.py).
        reaper = None
        if settings.reaper_interval_seconds > 0:
            from service.reaper import ReaperThread

            reaper = ReaperThread(settings.reaper_interval_seconds).start()
        # Send the job events the outbox holds to webhook endpoints (service/webhook_delivery.py).
        sender = None
        if settings.webhook_interval_seconds > 0:
            from service.webhook_delivery import WebhookThread

            sender = WebhookThread(settings.webhook_interval_seconds).start()
        try:
            yield
        finally:
            if reaper is not None:
                reaper.stop()
            if sender is not None:
                sender.stop()
            file_validation.stop_children()  # token counts of waiting jobs: the next start resumes them
            await close_read_pools()

    # /docs and /redoc are ours (service/api/docs.py): FastAPI's load their scripts from a CDN.
    # Every response carries the security headers (service/api/security_headers.py).
    app = SecureHeadersApp(
        title="Loraq",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(refuse_nul_in_query)],
    )
    install_error_handlers(app)
    if settings.cors_origins:  # off unless origins are listed explicitly
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
        )
    for router in (health.router, files.router, jobs.router, models.router, chat.router, webhooks.router):
        app.include_router(router)
    install_plain_routes(app, [jobs.status_read_route])
    # request metrics middleware + GET /metrics; the dashboard at / and its /static assets
    install_service_metrics(app, settings)
    mount_dashboard(app)
    mount_docs(app)
    app.openapi = lambda: openapi_without_422(app)  # type: ignore[method-assign]
    return app


def openapi_without_422(app: FastAPI) -> dict[str, Any]:
    """FastAPI documents a 422 on every route with inputs; ours answer 400 in OpenAI's error body
    (`install_error_handlers`), which the routers document, so the 422 entries go."""
    if app.openapi_schema is None:
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes
        )
        for operations in schema.get("paths", {}).values():
            for operation in operations.values():
                operation.get("responses", {}).pop("422", None)
                for param in operation.get("parameters", []):
                    if param.get("in") == "query":
                        _refuse_nul(param.get("schema", {}))
        for name in ("HTTPValidationError", "ValidationError"):
            schema.get("components", {}).get("schemas", {}).pop(name, None)
        app.openapi_schema = schema
    return app.openapi_schema


def _refuse_nul(schema: dict[str, Any]) -> None:
    """Documents what refuse_nul_in_query enforces: no query string value holds a NUL."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "string" and not {"enum", "const", "pattern"} & branch.keys():
            branch["pattern"] = "^[^\\u0000]*$"
