"""A small Hugging Face Hub for the suite: a real HTTP server (uvicorn in a thread of the test
process, tests/live_server.py) that answers the requests `huggingface_hub`'s client makes, the way
the Hub answers them, so Loraq's pull runs the real client against it (`HF_ENDPOINT`):

    GET  /api/models/{owner}/{name}[/revision/{rev}]   model info: `sha` (the commit) and
                                                      `siblings` (with ?blobs=true: size, blobId,
                                                      lfs.sha256 for weights)
    HEAD /{owner}/{name}/resolve/{rev}/{file}         ETag (LFS sha256, or git blob sha1),
                                                      X-Repo-Commit, Content-Length, Accept-Ranges
    GET  /{owner}/{name}/resolve/{rev}/{file}         the bytes; `Range: bytes=N-` answers 206

A `cdn` repository answers for its weights as the Hub does for LFS files: a 302 to a CDN on
another host (a second server) with X-Linked-Etag and X-Linked-Size. A gated repository answers
401 (no token) or 403 (another token) with `X-Error-Code: GatedRepo` unless the request carries
`Authorization: Bearer <its token>`; a missing one 404 with `X-Error-Code: RepoNotFound`, a
missing revision `RevisionNotFound`. Every request is recorded
(method, path, Authorization, Range) for the tests to check what the client sent. Files are
streamed in CHUNK-byte pieces, `delay` seconds apart (or held after the first until a test
releases them), so a test can stop a pull part-way or start another beside it.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from tests.live_server import serve

CHUNK = 16 * 1024
LFS_SUFFIXES = (".safetensors", ".bin", ".pt")  # as the Hub's .gitattributes stores them in LFS


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    commit: str
    gated_token: str | None = None  # a gated repository: only this bearer token reads it
    delay: float = 0.0  # seconds between CHUNK-byte pieces of a download
    # while set and not released, a download sends its first piece and then waits
    hold: threading.Event | None = None
    cdn: bool = False  # weights answered as the Hub answers LFS files: a 302 to the CDN

    def sibling(self, name: str) -> dict[str, Any]:
        data = self.files[name]
        entry: dict[str, Any] = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
        if name.endswith(LFS_SUFFIXES):
            entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
        return entry

    def etag(self, name: str) -> str:
        data = self.files[name]
        lfs = name.endswith(LFS_SUFFIXES)
        return hashlib.sha256(data).hexdigest() if lfs else git_blob_id(data)


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    authorization: str | None
    range: str | None


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""
    cdn_url: str = ""  # another host (port): where `cdn` repositories' weights redirect

    def publish_dir(self, repo_id: str, directory: Path, **options: Any) -> FakeRepo:
        """Serve every file of `directory` as repository `repo_id` (its commit: a digest of them)."""
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
        return self.publish(repo_id, files, **options)

    def publish(self, repo_id: str, files: dict[str, bytes], **options: Any) -> FakeRepo:
        digest = hashlib.sha1(usedforsecurity=False)
        for name, data in sorted(files.items()):
            digest.update(name.encode() + b"\0" + data)
        repo = FakeRepo(files, digest.hexdigest(), **options)
        self.repos[repo_id] = repo
        return repo

    def downloads(self, repo_id: str, name: str) -> list[Seen]:
        """The GETs of one file (HEADs and the API's look-ups left out; from the CDN for `cdn`)."""
        repo = self.repos[repo_id]
        cdn = f"/cdn/{repo.etag(name)}" if repo.cdn and name.endswith(LFS_SUFFIXES) else None
        path = f"/{repo_id}/resolve/"
        with self.lock:
            return [
                s
                for s in self.seen
                if s.method == "GET"
                and (s.path == cdn or (s.path.startswith(path) and s.path.endswith(name)))
            ]


def git_blob_id(data: bytes) -> str:
    """The git blob sha1 the Hub lists for a file kept in git (`git hash-object`)."""
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()


def _error(status: int, code: str, message: str) -> Response:
    return JSONResponse(
        {"error": message}, status_code=status, headers={"X-Error-Code": code, "X-Error-Message": message}
    )


def _record(app: FastAPI, hub: FakeHub) -> None:
    """Every request the app answers goes into `hub.seen`."""

    @app.middleware("http")
    async def record(request: Request, call_next: Any) -> Response:
        seen = Seen(
            request.method,
            request.url.path,
            request.headers.get("authorization"),
            request.headers.get("range"),
        )
        with hub.lock:
            hub.seen.append(seen)
        response: Response = await call_next(request)
        return response


def create_app(hub: FakeHub) -> FastAPI:
    app = FastAPI()
    _record(app, hub)

    def find(repo_id: str, revision: str, request: Request) -> FakeRepo | Response:
        repo = hub.repos.get(repo_id)
        if repo is None:
            return _error(404, "RepoNotFound", "Repository not found")
        if repo.gated_token is not None:
            sent = request.headers.get("authorization")
            if sent != f"Bearer {repo.gated_token}":
                status = 401 if sent is None else 403
                return _error(
                    status, "GatedRepo", "Access to this model is restricted: you must be authenticated"
                )
        if revision not in ("main", repo.commit):
            return _error(404, "RevisionNotFound", "Invalid rev id")
        return repo

    @app.get("/api/models/{owner}/{name}/revision/{revision}")
    @app.get("/api/models/{owner}/{name}")
    def model_info(owner: str, name: str, request: Request, revision: str = "main") -> Response:
        repo_id = f"{owner}/{name}"
        found = find(repo_id, revision, request)
        if isinstance(found, Response):
            return found
        siblings = [
            found.sibling(f) if request.query_params.get("blobs") else {"rfilename": f} for f in found.files
        ]
        gated = "auto" if found.gated_token else False
        return JSONResponse(
            {"id": repo_id, "modelId": repo_id, "sha": found.commit, "siblings": siblings, "gated": gated}
        )

    @app.api_route("/{owner}/{name}/resolve/{revision}/{filename}", methods=["GET", "HEAD"])
    def resolve(owner: str, name: str, revision: str, filename: str, request: Request) -> Response:
        found = find(f"{owner}/{name}", revision, request)
        if isinstance(found, Response):
            return found
        if filename not in found.files:
            return _error(404, "EntryNotFound", "Entry not found")
        data, etag = found.files[filename], found.etag(filename)
        if found.cdn and filename.endswith(LFS_SUFFIXES):
            # the Hub's LFS answer: a redirect to a CDN on another host, the file's etag and size
            # in X-Linked-* headers (the client drops the token when it follows it)
            linked = {
                "X-Linked-Etag": f'"{etag}"',
                "X-Linked-Size": str(len(data)),
                "X-Repo-Commit": found.commit,
            }
            return Response(status_code=302, headers={"Location": f"{hub.cdn_url}/cdn/{etag}", **linked})
        return _serve(data, {"ETag": f'"{etag}"', "X-Repo-Commit": found.commit}, request, found)

    return app


def create_cdn_app(hub: FakeHub) -> FastAPI:
    """The CDN a `cdn` repository's weights redirect to: any GET of a known sha256, no token."""
    app = FastAPI()
    _record(app, hub)

    @app.api_route("/cdn/{sha256}", methods=["GET", "HEAD"])
    def blob(sha256: str, request: Request) -> Response:
        for repo in hub.repos.values():
            for name, data in repo.files.items():
                if name.endswith(LFS_SUFFIXES) and hashlib.sha256(data).hexdigest() == sha256:
                    return _serve(data, {"ETag": f'"{sha256}"'}, request, repo)
        return Response(status_code=404)

    return app


def _serve(data: bytes, headers: dict[str, str], request: Request, repo: FakeRepo) -> Response:
    """`data` whole (200) or from `Range: bytes=N-` (206), in pieces as the repository says."""
    headers = {**headers, "Accept-Ranges": "bytes"}
    start, status = 0, 200
    asked = request.headers.get("range")
    if asked and asked.startswith("bytes=") and asked.endswith("-"):
        start, status = int(asked[len("bytes=") : -1]), 206
        headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
    headers["Content-Length"] = str(len(data) - start)
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers)
    pieces = _pieces(data[start:], repo.delay, repo.hold)
    return StreamingResponse(pieces, status_code=status, headers=headers)


async def _pieces(data: bytes, delay: float, hold: threading.Event | None) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), CHUNK):
        if delay and offset:
            await asyncio.sleep(delay)
        while offset and hold is not None and not hold.is_set():
            await asyncio.sleep(0.02)
        yield data[offset : offset + CHUNK]


@contextmanager
def running_hub() -> Iterator[FakeHub]:
    """A FakeHub served on a free port until the block ends (`hub.url` is its HF_ENDPOINT)."""
    hub = FakeHub()
    with serve(create_app(hub)) as url, serve(create_cdn_app(hub)) as cdn_url:
        hub.url, hub.cdn_url = url, cdn_url
        yield hub


@contextmanager
def hub_endpoint(monkeypatch: pytest.MonkeyPatch, repo_id: str, directory: Path) -> Iterator[FakeHub]:
    """A running FakeHub serving `directory` as `repo_id`, as this test's HF_ENDPOINT (no HF_TOKEN)."""
    with running_hub() as hub:
        hub.publish_dir(repo_id, directory)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield hub
