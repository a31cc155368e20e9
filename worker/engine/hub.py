"""Base models from the Hugging Face Hub, through `huggingface_hub`'s client: look a repository
up, check it is one Loraq can train, and download it into the model store, resumably.

`HF_ENDPOINT` names the Hub (a mirror, an internal proxy; default https://huggingface.co) and
`HF_TOKEN` the token sent as `Authorization: Bearer` (gated and private repositories); both are
read at each call (`HubAccess.from_env`), not when huggingface_hub is imported.

What a pull takes from a repository at one commit: config.json, the top-level *.safetensors
weights (and their index), the tokenizer and chat template files. Pickles (*.bin, *.pt) are never
fetched; a repository with no safetensors weights is refused before anything is downloaded. Each
file is fetched into `<dir>/.partial/<file>.<commit>.incomplete`, checked against the Hub's
digest (LFS sha256, or the git blob sha1 of a small file), then renamed into place; the marker
(catalog.HUB_MARKER) is written last. A pull that stops (a cancel, a killed worker, a dropped
connection) keeps its partial files: the next pull asks for the rest with an HTTP Range.

Pure Python (huggingface_hub, no torch): the API looks repositories up at submit.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx2

from worker.engine.atomic_files import write_atomic
from worker.engine.catalog import HUB_MARKER, hub_dir, hub_marker, is_hub_id
from worker.engine.model_shape import ModelShape, shape_of_config
from worker.engine.types import ModelError

DEFAULT_ENDPOINT = "https://huggingface.co"
PARTIAL_DIR = ".partial"
# top-level files a pull takes (fnmatch patterns); everything else (pickles, GGUF, ONNX,
# `original/` consolidated checkpoints, READMEs) stays on the Hub
WANTED = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_CHUNK = 1 << 20
LOOKUP_TIMEOUT = 20.0  # seconds for the Hub to answer a look-up (a submit waits for it)

# progress(done_bytes, total_bytes) over every file of the pull
HubProgress = Callable[[int, int], None]


class HubError(ModelError):
    """The Hub refused or could not answer: `code` says which (the API's 400 carries it)."""

    def __init__(self, code: str, message: str) -> None:
        self.code = code
        super().__init__(message)


@dataclass(frozen=True)
class HubAccess:
    endpoint: str
    token: str | None

    @classmethod
    def from_env(cls) -> HubAccess:
        endpoint = os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
        return cls(endpoint.rstrip("/"), os.environ.get("HF_TOKEN") or None)


@dataclass(frozen=True)
class HubFile:
    name: str
    size: int | None
    sha256: str | None  # LFS files (weights): the sha256 of the content
    blob_id: str | None  # git blob sha1 (small files kept in git)


@dataclass(frozen=True)
class HubRepo:
    repo_id: str
    revision: str
    commit: str
    files: tuple[HubFile, ...]  # what a pull downloads

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


def resolve(repo_id: str, revision: str | None, access: HubAccess) -> HubRepo:
    """The repository at `revision` (default main): its commit and the files a pull takes.
    HubError when it is gated, missing, unreachable, or holds no safetensors weights."""
    from huggingface_hub import HfApi

    if not is_hub_id(repo_id):
        raise HubError("invalid_model", f"{repo_id!r} is not a Hugging Face Hub id (owner/name)")
    rev = revision or "main"
    api = HfApi(endpoint=access.endpoint, token=access.token)
    with _hub_errors(repo_id, rev, access):
        info = api.model_info(repo_id, revision=rev, files_metadata=True, timeout=LOOKUP_TIMEOUT)
    if not info.sha:
        raise HubError("hub_unreachable", f"{access.endpoint} gave no commit for {repo_id} at {rev}")
    siblings = [s for s in info.siblings or [] if "/" not in s.rfilename]
    names = [s.rfilename for s in siblings]
    if not any(fnmatch.fnmatch(n, "*.safetensors") for n in names):
        pickles = [n for n in names if any(fnmatch.fnmatch(n, p) for p in PICKLES)]
        held = f"only pickle checkpoints ({', '.join(pickles)})" if pickles else "no *.safetensors weights"
        raise HubError(
            "unsupported_model",
            f"Hub model {repo_id} at {rev} holds {held}; Loraq loads safetensors only (pickles can "
            "run code): pick a repository or revision with safetensors weights, or convert them and "
            "register the directory with `loraq models add`",
        )
    if "config.json" not in names:
        raise HubError("unsupported_model", f"Hub model {repo_id} at {rev} has no config.json")
    files = tuple(
        HubFile(s.rfilename, s.size, s.lfs.sha256 if s.lfs else None, s.blob_id)
        for s in siblings
        if any(fnmatch.fnmatch(s.rfilename, p) for p in WANTED)
    )
    return HubRepo(repo_id, rev, info.sha, files)


def fetch_metadata(repo: HubRepo, store: Path, access: HubAccess) -> ModelShape:
    """Download the repository's small files (config.json, tokenizer and chat template: all but
    the weights) into its store directory, as the API does at submit so that it can name the
    family and count the examples' tokens, and read its family, size and context; ModelError
    for a family Loraq does not train."""
    directory = hub_dir(repo.repo_id, store)
    directory.mkdir(parents=True, exist_ok=True)
    for file in repo.files:
        if not fnmatch.fnmatch(file.name, "*.safetensors"):
            _fetch_file(repo, file, directory, access, lambda n: None)
    try:
        content = json.loads((directory / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HubError(
            "unsupported_model", f"config.json of {repo.repo_id} is not valid JSON: {exc}"
        ) from exc
    return shape_of_config(content, f"the config.json of Hub model {repo.repo_id}")


def check_hub_model(repo_id: str, store: Path, access: HubAccess) -> ModelShape:
    """What a submit asks of a Hub model that is not local yet: that the Hub serves it to this
    token, with safetensors weights, of a family Loraq trains (HubError/ModelError otherwise)."""
    return fetch_metadata(resolve(repo_id, None, access), store, access)


def download(repo: HubRepo, store: Path, access: HubAccess, progress: HubProgress | None = None) -> Path:
    """Download every file of `repo` into its store directory (resuming partial files), verify
    each, then write the marker. `progress` may raise (StopRequested): partial files are kept."""
    directory = hub_dir(repo.repo_id, store)
    directory.mkdir(parents=True, exist_ok=True)
    done = 0

    def advanced(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, repo.total_bytes)

    for file in repo.files:
        _fetch_file(repo, file, directory, access, advanced)
    marker = {
        "repo_id": repo.repo_id,
        "revision": repo.revision,
        "commit": repo.commit,
        "files": [f.name for f in repo.files],
    }
    write_atomic(directory / HUB_MARKER, json.dumps(marker, indent=2) + "\n", mode=0o644)
    return directory


def is_current(repo_id: str, store: Path, revision: str | None) -> bool:
    """Whether the store holds `repo_id` pulled at `revision` (any revision when None)."""
    marker = hub_marker(repo_id, store)
    if marker is None:
        return False
    return revision is None or revision in (marker.get("revision"), marker.get("commit"))


def _fetch_file(
    repo: HubRepo, file: HubFile, directory: Path, access: HubAccess, advanced: Callable[[int], None]
) -> None:
    """One file, resumed from its partial copy where there is one, verified, renamed into place."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    target = directory / file.name
    if target.is_file() and _verified(target, file):
        advanced(target.stat().st_size)
        return
    url = hf_hub_url(repo.repo_id, file.name, revision=repo.commit, endpoint=access.endpoint)
    with _hub_errors(repo.repo_id, repo.revision, access):
        meta = get_hf_file_metadata(url, token=access.token, endpoint=access.endpoint)
    headers = build_hf_headers(token=access.token)
    location = meta.location or url
    if urlparse(location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a CDN's signed URL: the token stays with the Hub
    partial = directory / PARTIAL_DIR / f"{file.name}.{repo.commit}.incomplete"
    partial.parent.mkdir(parents=True, exist_ok=True)
    expected = meta.size if meta.size is not None else file.size
    with partial.open("ab") as out:
        resume = out.tell()
        if expected is not None and resume > expected:  # not this file's prefix: start over
            out.truncate(0)
            resume = 0
        advanced(resume)
        with _hub_errors(repo.repo_id, repo.revision, access):
            http_get(
                location,
                out,
                resume_size=resume,
                headers=headers,
                expected_size=expected,
                displayed_filename=file.name,
                tqdm_class=_bar(advanced),
            )
        out.flush()
        os.fsync(out.fileno())
    if not _verified(partial, file):
        partial.unlink()  # a wrong copy is never resumed
        raise HubError(
            "hub_unreachable",
            f"{file.name} of {repo.repo_id} downloaded from {access.endpoint} does not match the "
            "Hub's digest; try again",
        )
    partial.chmod(0o644)
    os.replace(partial, target)


def _bar(advanced: Callable[[int], None]) -> type:
    """A tqdm stand-in for huggingface_hub's http_get: each chunk it writes is reported."""

    class Bar:
        def __init__(self, **_: Any) -> None:
            pass

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *_: object) -> None:
            return None

        def update(self, n: int) -> None:
            advanced(n)

    return Bar


def _verified(path: Path, file: HubFile) -> bool:
    """`path` holds `file` as the Hub lists it (sha256 for LFS files, git blob sha1 for others;
    only the size where the Hub gave neither)."""
    size = path.stat().st_size
    if file.size is not None and size != file.size:
        return False
    if file.sha256 is not None:
        digest = hashlib.sha256()
    elif file.blob_id is not None:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"blob {size}\0".encode())
    else:
        return file.size is not None
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == (file.sha256 or file.blob_id)


@contextmanager
def _hub_errors(repo_id: str, revision: str, access: HubAccess) -> Iterator[None]:
    """Turns huggingface_hub's errors into HubError saying what to do (a full disk's OSError,
    a stop and the engine's own errors pass through)."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    sent = "with the token in HF_TOKEN" if access.token else "without a token (HF_TOKEN is not set)"
    try:
        yield
    except GatedRepoError:
        raise HubError(
            "model_gated",
            f"Hub model {repo_id} is gated and {access.endpoint} refused it {sent}: accept its "
            "terms on its Hub page with your account, then set HF_TOKEN to a token of that account",
        ) from None
    except RevisionNotFoundError:
        raise HubError("revision_not_found", f"Hub model {repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise HubError(
            "model_not_on_hub",
            f"Hub model {repo_id} does not exist on {access.endpoint}, or is private and was asked "
            f"{sent}: check the id, or set HF_TOKEN to a token that can read it",
        ) from None
    except (HfHubHTTPError, httpx2.HTTPError) as exc:
        raise HubError(
            "hub_unreachable",
            f"could not download Hub model {repo_id} from {access.endpoint} (HF_ENDPOINT): {exc}",
        ) from None
    except OSError as exc:
        if exc.errno is not None:  # the disk (ENOSPC): the caller's disk-full handling takes it
            raise
        # huggingface_hub's "Consistency check failed": the server sent fewer bytes than it said
        raise HubError("hub_unreachable", f"download of Hub model {repo_id} failed: {exc}") from None
