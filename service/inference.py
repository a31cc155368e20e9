"""Chat completions: which weights a `model` names, and the Redis path to the inference workers.

A chat request does not go through Celery (no task message, no ack, no database job): the API
pushes one JSON request on a Redis list that `loraq inference` workers pop, and reads the
worker's answer from a reply list of its own, one JSON event per entry:

    loraq:inference:<queue>:requests   list   API RPUSH request, worker BLPOP
    loraq:inference:<queue>:workers    zset   worker id -> last heartbeat (unix s)
    loraq:inference:<queue>:starting   zset   worker id -> last heartbeat while it starts (imports
                                              torch, preloads models): not serving yet
    loraq:inference:reply:<request id> list   worker RPUSH events, API BLPOP; expires

Events: {"type": "loading", "model"} when the request waits for its base model to load (the
first request on a model after the worker started: tens of seconds on a CPU), repeated every
quarter of the worker's `inference_timeout_seconds` while the load lasts, so that a load longer
than the timeout does not read as a silent worker; {"type": "start",
"prompt_tokens", "load_seconds"} once the worker accepted the request (`load_seconds`: how long
loading its base model took, with "loading" before it); {"type":
"delta", "text"} per piece of text (streamed requests only); {"type": "done", "text",
"finish_reason", "prompt_tokens", "completion_tokens"}; or {"type": "error", "status", "code",
"param", "message"}. A job's dry run (`"kind": "dry_run"`) answers "done" with the files'
reports and the plan, sending {"type": "progress", "stage"} every quarter of the worker's
`inference_timeout_seconds` while it reads and tokenizes them (a large file takes minutes).

A request that finds no serving worker while one is starting waits for it up to
`inference_start_wait_seconds` (`loraq up` answers before its inference worker has imported torch);
with none serving or starting it is refused naming `loraq inference`.

No torch here: the API imports this module.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import bindparam, select

from service.db.models import Artifact, Checkpoint, Job, is_id
from service.db.session import read_first
from service.errors import InvalidRequestError, LoraqError, NotFoundError, UnavailableError
from service.settings import Settings
from worker.engine.catalog import get_model_info
from worker.engine.types import ModelError

REPLY_TTL_SECONDS = 300
WORKER_ALIVE_SECONDS = 15.0
SOCKET_MARGIN_SECONDS = 10.0
START_POLL_SECONDS = 0.25  # a request waiting for a starting worker looks this often
CKPT_PREFIX = "ckpt-step-"


def requests_key(queue: str) -> str:
    return f"loraq:inference:{queue}:requests"


WORKERS_PREFIX, WORKERS_SUFFIX = "loraq:inference:", ":workers"


def workers_key(queue: str) -> str:
    return f"{WORKERS_PREFIX}{queue}{WORKERS_SUFFIX}"


def reply_key(request_id: str) -> str:
    return f"loraq:inference:reply:{request_id}"


@dataclass(frozen=True)
class InferenceWorkerSeen:
    """An inference worker whose heartbeat is recent (the dashboard's Workers page lists it)."""

    queue: str
    worker_id: str  # "host:pid"
    last_seen: float  # its last heartbeat, unix seconds


def live_inference_workers(client: Any) -> list[InferenceWorkerSeen]:
    """Every inference worker of every queue heard from within `WORKER_ALIVE_SECONDS` (the rule a
    chat request is refused by), sorted by queue and id. `client` is a synchronous Redis client."""
    since = time.time() - WORKER_ALIVE_SECONDS
    seen = []
    for raw in client.scan_iter(match=workers_key("*"), count=500):
        key = raw.decode() if isinstance(raw, bytes) else str(raw)
        queue = key.removeprefix(WORKERS_PREFIX).removesuffix(WORKERS_SUFFIX)
        for member, score in client.zrangebyscore(key, since, "+inf", withscores=True):
            worker_id = member.decode() if isinstance(member, bytes) else str(member)
            seen.append(InferenceWorkerSeen(queue=queue, worker_id=worker_id, last_seen=float(score)))
    return sorted(seen, key=lambda w: (w.queue, w.worker_id))


@dataclass(frozen=True)
class Target:
    """What serves a `model`: a base model of the catalog, plus a stored PEFT adapter zip or None."""

    base: str
    adapter_key: str | None = None
    adapter_sha256: str | None = None


def _not_found(model: str, why: str = "") -> NotFoundError:
    return NotFoundError(
        f"The model {model!r} does not exist or you do not have access to it{why}",
        param="model",
        code="model_not_found",
    )


# Module constants: `read_first` compiles each statement once (the chat hot path).
_JOB = select(Job.id, Job.model, Job.suffix, Job.status, Job.fine_tuned_model).where(
    Job.id == bindparam("job_id"), Job.tenant_id == bindparam("tenant_id")
)
_ADAPTER = select(Artifact.storage_key, Artifact.sha256).where(
    Artifact.job_id == bindparam("job_id"), Artifact.kind == bindparam("kind")
)
_CHECKPOINT = select(Checkpoint.storage_key, Checkpoint.sha256).where(
    Checkpoint.job_id == bindparam("job_id"), Checkpoint.step == bindparam("step")
)


async def resolve_model(*, tenant_id: str, model: str, settings: Settings) -> Target:
    """A base model name, a job's `fine_tuned_model` (`ft:<base>:<suffix>:<job id>`) or a
    checkpoint's `fine_tuned_model_checkpoint` (`...:ckpt-step-<n>`) of this tenant; else 404
    (another tenant's model included: its existence is not revealed)."""
    if not model.startswith("ft:"):
        try:
            info = get_model_info(model, settings.model_store)
        except ModelError:
            raise _not_found(model) from None
        if not info.pulled:
            raise _not_found(model, f"; it is not pulled yet: run `loraq models pull {model}`")
        return Target(base=model)
    parts = model.split(":")
    if len(parts) not in (4, 5) or not is_id(parts[3]):
        raise _not_found(model)
    job = await read_first(_JOB, {"job_id": parts[3], "tenant_id": tenant_id})
    if job is None or job.model != parts[1] or (job.suffix or "") != parts[2]:
        raise _not_found(model)
    if len(parts) == 4:
        artifact = await read_first(_ADAPTER, {"job_id": job.id, "kind": "adapter"})
        if job.status != "succeeded" or job.fine_tuned_model != model or artifact is None:
            raise _not_found(model)
        return Target(job.model, artifact.storage_key, artifact.sha256)
    step = parts[4].removeprefix(CKPT_PREFIX)
    if not parts[4].startswith(CKPT_PREFIX) or not step.isdigit():
        raise _not_found(model)
    ckpt = await read_first(_CHECKPOINT, {"job_id": job.id, "step": int(step)})
    if ckpt is None:
        raise _not_found(model)
    return Target(job.model, ckpt.storage_key, ckpt.sha256)


def new_request_id() -> str:
    return f"chatcmpl-{secrets.token_urlsafe(18)}"


def worker_error(event: dict[str, Any]) -> LoraqError:
    """The error a worker reported, as the API's error type of the same status."""
    status = int(event.get("status", 500))
    message = str(event.get("message", "inference failed"))
    param, code = event.get("param"), event.get("code")
    if status == 400:
        return InvalidRequestError(message, param=param, code=code)
    if status == 404:
        return NotFoundError(message, param=param, code=code)
    return LoraqError(message, param=param, code=code)


def starting_key(queue: str) -> str:
    return f"loraq:inference:{queue}:starting"


def inference_worker_id(pid: int) -> str:
    """The id an inference worker registers under: "host:pid" (`loraq up` marks its child with it)."""
    return f"{socket.gethostname()}:{pid}"


def mark_starting(client: Any, queue: str, worker_id: str) -> None:
    """Say that `worker_id` is starting on `queue` (a synchronous client): requests wait for it."""
    client.zadd(starting_key(queue), {worker_id: time.time()})


class Completion:
    """One request in flight: `submit()` sends it, `events()` yields the worker's events."""

    def __init__(self, settings: Settings, request: dict[str, Any]) -> None:
        from service.redis_client import async_redis_client

        self.settings = settings
        self.request = request
        self.id: str = request["id"]
        # BLPOP waits up to the inference timeout: the socket must wait longer (redis-py's default
        # read timeout is 5 s, shorter than a long prompt's prefill on a busy worker)
        self.client = async_redis_client(
            settings, socket_timeout=settings.inference_timeout_seconds + SOCKET_MARGIN_SECONDS
        )

    async def submit(self) -> None:
        queue = self.settings.inference_queue
        timeout = self.settings.inference_timeout_seconds
        try:
            if not await self._alive(workers_key(queue)):
                await self._wait_for_start(queue)
            self.request["sent_at"] = time.time()
            self.request["deadline"] = self.request["sent_at"] + timeout
            await self.client.rpush(requests_key(queue), json.dumps(self.request))
        except LoraqError:
            await self.close()
            raise
        except Exception as exc:
            await self.close()
            raise UnavailableError(f"the inference queue is unreachable: {exc}") from exc

    async def _alive(self, key: str) -> int:
        return int(await self.client.zcount(key, time.time() - WORKER_ALIVE_SECONDS, "+inf"))

    async def _wait_for_start(self, queue: str) -> None:
        """No worker serves `queue`: wait up to `inference_start_wait_seconds` for one that is
        starting; refuse naming `loraq inference` only when none is."""
        wait = self.settings.inference_start_wait_seconds
        deadline = time.monotonic() + wait
        # serving first: a worker that registers leaves the starting set a moment later
        while not await self._alive(workers_key(queue)):
            if not await self._alive(starting_key(queue)):
                raise UnavailableError(
                    f"no inference worker is serving queue {queue!r}; start one with `loraq inference`",
                    code="no_inference_worker",
                )
            if time.monotonic() >= deadline:
                raise UnavailableError(
                    f"the inference worker of queue {queue!r} is still starting (importing torch, "
                    f"loading its models) after {wait:g}s; retry in a moment",
                    code="inference_worker_starting",
                )
            await asyncio.sleep(START_POLL_SECONDS)

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The worker's events up to and including `done`; an `error` event or a silent worker
        (no event for `inference_timeout_seconds`) raises."""
        key = reply_key(self.id)
        while True:
            item = await self.client.blpop([key], timeout=self.settings.inference_timeout_seconds)
            if item is None:
                raise UnavailableError(
                    f"no answer from an inference worker in {self.settings.inference_timeout_seconds:g}s",
                    code="inference_timeout",
                )
            event: dict[str, Any] = json.loads(item[1])
            if event["type"] == "error":
                raise worker_error(event)
            yield event
            if event["type"] == "done":
                return

    async def close(self) -> None:
        await self.client.aclose()


async def call(settings: Settings, request: dict[str, Any]) -> dict[str, Any]:
    """Send `request` and return the worker's `done` event (an `error` event raises)."""
    completion = Completion(settings, request)
    await completion.submit()
    try:
        done: dict[str, Any] = {}
        async for event in completion.events():
            done = event
        return done
    finally:
        await completion.close()
