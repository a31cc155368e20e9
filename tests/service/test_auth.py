"""API keys: generation, HMAC storage, bootstrap, revocation, and 401 on every /v1 route."""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
from typing import Any

import pytest
from sqlalchemy import select

from service import auth
from service.db.models import ApiKey
from service.db.session import session_scope
from service.settings import get_settings
from tests.conftest import ApiClient, LoraqEnv
from tests.service.test_api_files import assert_error


def v1_routes(api: ApiClient) -> list[tuple[str, str]]:
    spec: dict[str, Any] = api.client.app.openapi()
    return [
        (method.upper(), path)
        for path, ops in spec["paths"].items()
        if path.startswith("/v1/")
        for method in ops
    ]


def test_keys_are_random_and_stored_only_as_hmac(loraq_env: LoraqEnv) -> None:
    with session_scope() as s:
        k1 = auth.create_key(s, "acme")
        k2 = auth.create_key(s, "acme")
    assert k1 != k2 and k1.startswith("sk-lq-")
    assert len(k1) - len("sk-lq-") >= 43  # 32 random bytes, url-safe base64: 256 bits
    secret = get_settings().secret_key
    assert secret
    with session_scope() as s:
        rows = list(s.scalars(select(ApiKey)))
        hashes = {r.key_hash for r in rows}
        for k in (k1, k2):
            assert hmac.new(secret.encode(), k.encode(), hashlib.sha256).hexdigest() in hashes
        for r in rows:
            assert k1 not in (r.prefix, r.key_hash) and k2 not in (r.prefix, r.key_hash)
        listed = [i for i in auth.list_keys(s) if i.tenant == "acme"]
        assert [i.prefix for i in listed] == [k1[:14], k2[:14]]
        assert all(i.revoked_at is None for i in listed)


def test_secret_is_generated_once_under_the_data_dir(
    loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LORAQ_SECRET_KEY")
    get_settings.cache_clear()
    first = auth.server_secret()
    path = loraq_env.data_dir / auth.SECRET_FILE
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert len(first) == 64 and path.read_text() == first.decode()
    auth._secret_for.cache_clear()
    get_settings.cache_clear()  # a new process: new Settings, secret read back from the file
    assert auth.server_secret() == first  # a restarted process reads the same secret
    with session_scope() as s:
        key = auth.create_key(s, "gen")
    with session_scope() as s:
        assert auth.authenticate(s, key).name == "gen"


def test_bootstrap_key_is_idempotent(api: ApiClient) -> None:
    key = "sk-lq-bootstrap-" + "x" * 32
    with session_scope() as s:
        t1 = auth.ensure_bootstrap_key(s, key)
    with session_scope() as s:
        t2 = auth.ensure_bootstrap_key(s, key)
    assert t1.id == t2.id and t1.name == "default"
    r = api.client.get("/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200
    with pytest.raises(auth.InvalidRequestError), session_scope() as s:
        auth.ensure_bootstrap_key(s, "short")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer sk-lq-not-a-real-key"},
        {"Authorization": "Bearer "},
        {"Authorization": "Basic dXNlcjpwYXNz"},
        {"Authorization": "sk-lq-no-scheme"},
    ],
)
def test_every_v1_route_is_401_without_a_valid_key(api: ApiClient, headers: dict[str, str]) -> None:
    routes = v1_routes(api)
    assert len(routes) >= 14
    for method, path in routes:
        url = path.replace("{", "").replace("}", "")  # any id: auth is checked first
        r = api.client.request(method, url, headers=headers)
        err = assert_error(r, 401)
        assert r.headers["www-authenticate"] == "Bearer", (method, path)
        assert err["type"] == "invalid_request_error"


def test_revoked_key_is_401_and_others_keep_working(api: ApiClient) -> None:
    assert api.get("/v1/files").status_code == 200
    with session_scope() as s:
        auth.revoke_key(s, api.key[: auth.PREFIX_CHARS])
    err = assert_error(api.get("/v1/files"), 401)
    assert err["code"] == "revoked_api_key"
    assert api.other is not None and api.other.get("/v1/files").status_code == 200
    with pytest.raises(auth.NotFoundError), session_scope() as s:
        auth.revoke_key(s, "sk-lq-unknown")


def test_health_needs_no_key(api: ApiClient) -> None:
    assert api.client.get("/healthz").json() == {"status": "ok", "checks": {}, "latency_ms": {}}
    ready = api.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "redis": "ok"}
    latency = ready.json()["latency_ms"]  # each dependency's check, timed
    assert set(latency) == {"database", "redis"} and all(0 <= v < 2000 for v in latency.values())
    assert api.client.get("/openapi.json").status_code == 200
    assert api.client.get("/docs").status_code == 200


def test_readyz_is_503_when_redis_is_unreachable(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.up import free_port

    monkeypatch.setenv("LORAQ_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0")
    get_settings.cache_clear()
    r = api.client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["checks"]["database"] == "ok" and r.json()["checks"]["redis"].startswith("error")


def test_readyz_is_503_for_a_malformed_redis_url(api: ApiClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAQ_REDIS_URL", "localhost:6379")  # no scheme: redis-py raises ValueError
    get_settings.cache_clear()
    r = api.client.get("/readyz")
    assert r.status_code == 503 and r.json()["checks"]["redis"] == "error: ValueError"


def test_readyz_is_503_when_the_database_is_unreachable(
    api: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.up import free_port

    monkeypatch.setenv("LORAQ_DATABASE_URL", f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nodb")
    get_settings.cache_clear()
    r = api.client.get("/readyz")
    assert r.status_code == 503
    assert r.json()["checks"]["database"].startswith("error") and r.json()["checks"]["redis"] == "ok"
