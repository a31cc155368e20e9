"""`/docs` (Swagger UI), `/redoc` and `/favicon.ico`, every asset served by the service itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so they are blank offline and carry an
inline script. Ours take the JS and CSS that the `fastapi-offline` package ships (MIT; Swagger UI and
ReDoc's standalone builds) under `/docs-assets`, and start Swagger UI from a static script
(`static/docs/swagger-init.js`), so a Content-Security-Policy of 'self' holds for scripts (the
pages send `DOCS_CSP`; ReDoc needs inline styles).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from service.api.security_headers import DOCS_CSP

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
VENDOR_DIR = Path(fastapi_offline.__file__).resolve().parent / "static"
ASSETS_URL = "/docs-assets"

router = APIRouter(include_in_schema=False)


@lru_cache
def _page(name: str) -> str:
    return (STATIC_DIR / "docs" / name).read_text()


def _html(name: str) -> HTMLResponse:
    return HTMLResponse(_page(name), headers={"Content-Security-Policy": DOCS_CSP})


@router.get("/docs", response_class=HTMLResponse)
def swagger_ui() -> HTMLResponse:
    return _html("swagger.html")


@router.get("/redoc", response_class=HTMLResponse)
def redoc() -> HTMLResponse:
    return _html("redoc.html")


@router.get("/favicon.ico")
def favicon() -> FileResponse:
    return FileResponse(STATIC_DIR / "favicon.ico", media_type="image/x-icon")


def mount_docs(app: FastAPI) -> None:
    """On an app made with `docs_url=None, redoc_url=None`."""
    app.include_router(router)
    app.mount(ASSETS_URL, StaticFiles(directory=VENDOR_DIR), name="docs-assets")
