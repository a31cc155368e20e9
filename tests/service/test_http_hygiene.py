"""HTTP hygiene. 405 names every method of the path in `Allow`; the dashboard's pages
carry a CSP without inline script, anti-framing, nosniff and a referrer policy, and every other
response (docs, assets, the REST API, errors) the same headers; /metrics can require a bearer
token; a results CSV answers text/csv; the dashboard API documents its 4xx."""

from __future__ import annotations

import re

import pytest

from service import files
from service.api.security_headers import DOCS_CSP
from service.db.session import session_scope
from service.settings import get_settings
from tests.conftest import ApiClient, LoraqEnv

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("PUT", "/v1/files", "GET, POST"),
        ("PATCH", "/v1/files/file-abc", "GET, DELETE"),
        ("DELETE", "/v1/fine_tuning/jobs", "GET, POST"),
        ("GET", "/v1/fine_tuning/jobs/ftjob-x/cancel", "POST"),
        ("POST", "/healthz", "GET"),
        ("POST", "/static/dashboard/app.css", "GET, HEAD"),
    ],
)
def test_405_allow_lists_every_method_of_the_path(api: ApiClient, method: str, path: str, allow: str) -> None:
    r = api.request(method, path)
    assert r.status_code == 405, r.text
    assert r.headers["Allow"] == allow
    err = r.json()["error"]
    assert err["code"] == "method_not_allowed" and f"allowed: {allow}" in err["message"]


@pytest.mark.parametrize("path", ["/", "/new", "/jobs/ftjob-x", "/workers", "/compare?ids=ftjob-x"])
def test_dashboard_pages_set_security_headers_and_hold_no_inline_script(api: ApiClient, path: str) -> None:
    r = api.client.get(path)
    assert r.status_code == 200
    csp = r.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert r.headers["X-Frame-Options"] == "DENY"
    assert r.headers["X-Content-Type-Options"] == "nosniff"
    assert r.headers["Referrer-Policy"] == "same-origin"
    html = r.text
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, flags=re.S)
    assert scripts and all("src=" in attrs and not body.strip() for attrs, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", html) and "style=" not in html and "javascript:" not in html


@pytest.mark.parametrize(
    "path",
    [
        "/docs",
        "/redoc",
        "/openapi.json",
        "/docs-assets/swagger-ui.css",
        "/static/dashboard/app.css",
        "/favicon.ico",
        "/v1/models",
        "/v1/files/file-nope",
        "/dashboard/api/jobs",
        "/healthz",
        "/metrics",
        "/no/such/url",
    ],
)
@pytest.mark.parametrize("authorized", [True, False])
def test_every_response_carries_the_security_headers(api: ApiClient, path: str, authorized: bool) -> None:
    """Not only the dashboard's pages: docs, assets, the REST API and its errors too."""
    r = api.get(path) if authorized else api.client.get(path)
    assert r.headers["X-Content-Type-Options"] == "nosniff", r.status_code
    assert r.headers["X-Frame-Options"] == "DENY"
    assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]
    assert r.headers["Referrer-Policy"] == "same-origin"
    if path in ("/docs", "/redoc"):  # pages: same-origin scripts only, never inline ones
        assert r.headers["Content-Security-Policy"] == DOCS_CSP
        assert "script-src 'self';" in DOCS_CSP
    else:  # data and assets load nothing
        assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")


def test_an_unexpected_error_carries_the_security_headers_too(loraq_env: LoraqEnv) -> None:
    from fastapi.testclient import TestClient

    from service.app import create_app

    app = create_app()

    def boom() -> None:
        raise RuntimeError("a bug")

    app.add_api_route("/boom", boom)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/boom")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert r.headers["X-Content-Type-Options"] == "nosniff" and r.headers["X-Frame-Options"] == "DENY"


def test_metrics_needs_a_bearer_token(
    api: ApiClient, loraq_env: LoraqEnv, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, the token is generated once in the data dir (owner-only); set, the setting's."""
    path = loraq_env.data_dir / "metrics_token"
    generated = path.read_text()  # made when the app was
    assert len(generated) >= 40 and path.stat().st_mode & 0o777 == 0o600
    assert "loraq_" in api.scrape_metrics()
    monkeypatch.setenv("LORAQ_METRICS_BEARER_TOKEN", "scrape-secret")
    get_settings.cache_clear()
    for token in ("scrape-secret", generated):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"}):
            r = api.client.get("/metrics", headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer", headers
    assert api.client.get("/metrics", headers={"Authorization": f"Bearer {generated}"}).status_code == 401
    ok = api.client.get("/metrics", headers={"Authorization": "Bearer scrape-secret"})
    assert ok.status_code == 200 and "loraq_" in ok.text


def test_results_csv_answers_text_csv(api: ApiClient) -> None:
    with session_scope() as s:
        row = files.create_file_from_bytes(
            s, tenant_id=api.tenant_id, filename="r.csv", purpose="fine-tune-results", content=b"step\n1\n"
        )
        file_id = row.id
    r = api.get(f"/v1/files/{file_id}/content")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/csv")
    assert r.text == "step\n1\n"


def test_dashboard_api_documents_its_4xx(api: ApiClient) -> None:
    paths = api.client.get("/openapi.json").json()["paths"]
    dashboard = {p: ops for p, ops in paths.items() if p.startswith("/dashboard/api/")}
    assert dashboard
    for path, ops in dashboard.items():
        for op in ops.values():
            documented = set(op["responses"])
            assert {"400", "401", "404", "429"} <= documented, (path, documented)
            assert op["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith(
                "ErrorResponse"
            )
