"""`/healthz` (the process answers) and `/readyz` (its database and Redis answer). No auth."""

from __future__ import annotations

import redis
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from service.broker import broker_url
from service.db.session import get_engine
from service.schemas import HealthPublic
from service.settings import get_settings

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthPublic)
def healthz() -> HealthPublic:
    return HealthPublic(status="ok")


def _check_db() -> str:
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as e:
        return f"error: {type(e).__name__}"
    return "ok"


def _check_redis() -> str:
    url = broker_url(get_settings())
    try:
        client = redis.Redis.from_url(url, **get_settings().redis_timeouts)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError) as e:  # ValueError: a malformed LORAQ_REDIS_URL
        return f"error: {type(e).__name__}"
    return "ok"


@router.get("/readyz", response_model=HealthPublic, responses={503: {"model": HealthPublic}})
def readyz() -> JSONResponse:
    checks = {"database": _check_db(), "redis": _check_redis()}
    ok = all(v == "ok" for v in checks.values())
    body = HealthPublic(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)
