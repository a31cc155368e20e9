"""App-level behaviour: migrations on start only when asked, CORS off unless origins are listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, inspect, pool

from service.app import create_app
from service.settings import Settings, get_settings
from tests.conftest import ApiClient


def table_names(url: str) -> set[str]:
    engine = create_engine(url, poolclass=pool.NullPool)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


@pytest.mark.parametrize("migrate", [False, True])
def test_migrations_run_on_start_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, migrate: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'app.db'}"
    monkeypatch.setenv("LORAQ_DATABASE_URL", url)
    monkeypatch.setenv("LORAQ_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LORAQ_MIGRATE_ON_START", json.dumps(migrate))
    get_settings.cache_clear()
    try:
        with TestClient(create_app()) as client:
            assert client.get("/healthz").status_code == 200
        assert ("jobs" in table_names(url)) is migrate
    finally:
        get_settings.cache_clear()


def test_cors_is_off_by_default(api: ApiClient) -> None:
    r = api.client.options(
        "/v1/files", headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "GET"}
    )
    assert "access-control-allow-origin" not in r.headers
    r = api.get("/v1/files", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_allows_only_the_listed_origins(api: ApiClient) -> None:
    settings = Settings(cors_origins=["https://dash.example"])
    with TestClient(create_app(settings)) as client:
        ok = client.options(
            "/v1/files",
            headers={"Origin": "https://dash.example", "Access-Control-Request-Method": "GET",
                     "Access-Control-Request-Headers": "authorization"},
        )  # fmt: skip
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "https://dash.example"
        other = client.get("/v1/files", headers={**api.headers, "Origin": "https://evil.example"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers


def test_openapi_documents_400_error_bodies_not_422(api: ApiClient) -> None:
    spec = api.client.get("/openapi.json").json()
    statuses = {s for ops in spec["paths"].values() for op in ops.values() for s in op.get("responses", {})}
    assert "422" not in statuses
    post_job = spec["paths"]["/v1/fine_tuning/jobs"]["post"]["responses"]
    assert post_job["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorResponse"
    }
    assert spec["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"
