"""`/healthz` (the process answers) and `/readyz` (its database and Redis answer, each with the
check's latency; every check bounded by the settings' timeouts). No auth."""

from __future__ import annotations

import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.dependency import database_down, redis_down
from service.schemas import HealthPublic
from service.settings import get_settings

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=HealthPublic)
async def healthz() -> HealthPublic:
    # async: answered on the event loop, so it answers even when every worker thread is busy
    return HealthPublic(status="ok")


def _check_db() -> str:
    why = database_down()
    return "ok" if why is None else f"error: {why}"


def _check_redis() -> str:
    why = redis_down(get_settings())
    return "ok" if why is None else f"error: {why}"


@router.get("/readyz", response_model=HealthPublic, responses={503: {"model": HealthPublic}})
def readyz() -> JSONResponse:
    checks: dict[str, str] = {}
    latency_ms: dict[str, float] = {}
    for name, check in (("database", _check_db), ("redis", _check_redis)):
        t0 = time.perf_counter()
        checks[name] = check()
        latency_ms[name] = round((time.perf_counter() - t0) * 1000, 2)
    ok = all(v == "ok" for v in checks.values())
    body = HealthPublic(status="ok" if ok else "unavailable", checks=checks, latency_ms=latency_ms)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)
