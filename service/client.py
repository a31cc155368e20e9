"""A small typed HTTP client for the Loraq REST API, used by the CLI.

Base URL and key come from the caller (`--url/--api-key`), else from the settings
(`LORAQ_URL`, default http://127.0.0.1:8000, and `LORAQ_API_KEY`).
Every non-2xx answer raises `ApiError` carrying OpenAI's error body fields; a server that cannot be
reached (refused, unknown host, timed out) raises `ServerUnreachable`. Both are `ClientError`s, the
errors the CLI prints as one line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import httpx

from service.settings import get_settings

CHUNK_BYTES = 1 << 20


class ClientError(RuntimeError):
    """An expected failure of a call: its message is one line that says what to do."""


class ApiError(ClientError):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # the field first: it is what the user has to change
        where = f"{param}: " if param else ""
        super().__init__(f"{where}{message} (HTTP {status})")


class ServerUnreachable(ClientError):
    def __init__(self, url: str, cause: str) -> None:
        self.url = url
        self.cause = cause
        hint = "is `loraq up` running? set LORAQ_URL"
        super().__init__(f"cannot reach the Loraq API at {url}: {cause}; {hint}")


def _cause(exc: httpx.TransportError) -> str:
    """'connection refused', 'timed out', or the socket error's own words without '[Errno N]'."""
    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    text = str(exc) or type(exc).__name__
    if "]" in text and text.startswith("[Errno"):
        text = text.split("]", 1)[1].strip()
    return text[:1].lower() + text[1:]


def _raise_for(resp: httpx.Response) -> None:
    if resp.is_success:
        return
    resp.read()
    try:
        err = resp.json()["error"]
        raise ApiError(resp.status_code, str(err.get("message")), err.get("param"), err.get("code"))
    except (ValueError, KeyError, TypeError):
        raise ApiError(resp.status_code, resp.text[:500]) from None


class LoraqClient:
    def __init__(self, url: str | None = None, api_key: str | None = None, timeout: float = 30.0) -> None:
        settings = get_settings()
        base = (url or settings.url).rstrip("/")
        key = api_key or settings.api_key
        if not key:
            raise ClientError(
                "no API key: pass --api-key or set LORAQ_API_KEY (`loraq up` printed where its key is)"
            )
        self.base_url = base
        self.http = httpx.Client(
            base_url=base + "/v1", headers={"Authorization": f"Bearer {key}"}, timeout=timeout
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> LoraqClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @contextmanager
    def _reaching(self) -> Iterator[None]:
        """Turn a transport failure (refused, DNS, timeout) into `ServerUnreachable`."""
        try:
            yield
        except httpx.TransportError as e:
            raise ServerUnreachable(self.base_url, _cause(e)) from e

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        with self._reaching():
            resp = self.http.request(method, path, **kw)
        _raise_for(resp)
        body: dict[str, Any] = resp.json()
        return body

    # files
    def upload_file(self, path: Path, purpose: str = "fine-tune") -> dict[str, Any]:
        with path.open("rb") as fh:
            return self._json("POST", "/files", data={"purpose": purpose}, files={"file": (path.name, fh)})

    def list_files(self) -> dict[str, Any]:
        return self._json("GET", "/files")

    # jobs
    def create_job(self, body: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._json("POST", "/fine_tuning/jobs", json=body, headers=headers)

    def list_jobs(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json("GET", "/fine_tuning/jobs", params=params)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/fine_tuning/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self.job_action(job_id, "cancel")

    def job_action(self, job_id: str, action: Literal["cancel", "pause", "resume"]) -> dict[str, Any]:
        return self._json("POST", f"/fine_tuning/jobs/{job_id}/{action}")

    def list_events(self, job_id: str, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"limit": limit}
        if after:
            params["after"] = after
        return self._json("GET", f"/fine_tuning/jobs/{job_id}/events", params=params)

    def list_checkpoints(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/fine_tuning/jobs/{job_id}/checkpoints")

    @contextmanager
    def stream_adapter(self, job_id: str) -> Iterator[httpx.Response]:
        with self._reaching(), self.http.stream("GET", f"/fine_tuning/jobs/{job_id}/adapter") as resp:
            _raise_for(resp)
            yield resp

    def download_adapter(
        self, job_id: str, dest: Path, on_progress: Callable[[int, int | None], None] | None = None
    ) -> int:
        """Stream the adapter zip to `dest` (via a temp file); return its size in bytes."""
        tmp = dest.with_name(dest.name + ".part")
        done = 0
        with self.stream_adapter(job_id) as resp, tmp.open("wb") as out:
            total = int(resp.headers["content-length"]) if "content-length" in resp.headers else None
            for chunk in resp.iter_bytes(CHUNK_BYTES):
                out.write(chunk)
                done += len(chunk)
                if on_progress:
                    on_progress(done, total)
        tmp.replace(dest)
        return done
