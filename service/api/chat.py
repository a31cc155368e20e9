"""`POST /v1/chat/completions`: OpenAI's chat completions, served by `loraq inference` workers.

The route resolves `model` for the tenant (service.inference.resolve_model), hands the request to
a worker over Redis and turns the worker's events into OpenAI's response: one JSON body, or
Server-Sent Events of `chat.completion.chunk` objects ending with `data: [DONE]`. The first event
is awaited before answering, so a request the worker refuses (prompt too long, adapter that does
not fit) is an HTTP error in both modes, except behind a model that must load first: a stream
answers at once then, with an SSE comment and a `notice` on its first chunk saying the model is
loading (tens of seconds on a CPU), and a refusal after the load arrives in the stream. A
non-streamed answer says in `notice` that the model was loaded for it, and how long that took.

A model with random weights (a preset, or an adapter trained on one) answers with a `warning`
(worker.engine.catalog.random_weights_warning): on the completion, on a stream's first chunk.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from service import inference
from service.auth import CurrentTenant
from service.errors import InvalidRequestError, LoraqError, error_body
from service.schemas import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionCreate,
    ChatMessage,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    ChunkToolCall,
    TokenLogprobPublic,
    Usage,
    error_responses,
)
from service.settings import get_settings
from worker.engine.catalog import random_weights_warning

router = APIRouter(prefix="/v1/chat", tags=["chat"], responses=error_responses(400, 401, 404, 429, 503))

SSE_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {"application/json": {}, "text/event-stream": {}},
        "description": "A chat.completion, or with `stream` chat.completion.chunk events ending with [DONE]",
    }
}


def worker_request(body: ChatCompletionCreate, target: inference.Target, request_id: str) -> dict[str, Any]:
    """The JSON a worker receives (service.inference describes the protocol)."""
    return {
        "id": request_id,
        "base": target.base,
        "adapter_key": target.adapter_key,
        "adapter_sha256": target.adapter_sha256,
        "messages": [worker_message(m) for m in body.messages],
        # rendered by the model's chat template; the answer's calls come back as tool_calls
        "tools": (
            [t.model_dump(exclude_none=True) for t in body.tools]
            if body.tools and body.tool_choice != "none"
            else None
        ),
        "max_tokens": body.max_completion_tokens or body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "seed": body.seed,
        "stop": body.stop_list(),
        "stream": body.stream,
        # None: no logprobs; k: each token's and the k most likely (worker.engine.serving)
        "top_logprobs": (body.top_logprobs or 0) if body.logprobs else None,
    }


def worker_message(m: ChatMessage) -> dict[str, Any]:
    # "developer" is OpenAI's newer name for the system role; templates know "system"
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def answer_deltas(event: dict[str, Any]) -> list[ChunkDelta]:
    """A request with tools is answered whole at its end (only then can a call be told from
    text): its content, then its tool calls, as a stream's deltas."""
    deltas = []
    if event.get("buffered") and event.get("text"):
        deltas.append(ChunkDelta(content=event["text"]))
    if event.get("tool_calls"):
        calls = [ChunkToolCall(index=i, **call) for i, call in enumerate(event["tool_calls"])]
        deltas.append(ChunkDelta(tool_calls=calls))
    return deltas


@dataclass(frozen=True)
class ChunkHead:
    """What a stream's first chunk says beyond OpenAI's fields (the others leave them out)."""

    warning: str | None
    notice: str | None


def loading_notice(model: str) -> str:
    return (
        f"{model} is loading on the inference worker (the first request for it since the worker "
        "started; tens of seconds on a CPU); the answer starts once it is loaded"
    )


def loaded_notice(model: str, seconds: float) -> str:
    return (
        f"{model} was loaded on the inference worker for this request first ({seconds:g} s); "
        "later requests skip that"
    )


def _logprobs(event: dict[str, Any]) -> ChoiceLogprobs | None:
    """A worker event's `logprobs` (OpenAI's content entries), where the request asked for them."""
    entries = event.get("logprobs")
    if entries is None:
        return None
    return ChoiceLogprobs(content=[TokenLogprobPublic(**e) for e in entries])


def usage_of(event: dict[str, Any]) -> Usage:
    prompt, completion = int(event["prompt_tokens"]), int(event["completion_tokens"])
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


@router.post("/completions", response_model=ChatCompletion, responses=SSE_RESPONSE)
async def create_chat_completion(body: ChatCompletionCreate, tenant: CurrentTenant) -> Any:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError(
            "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value"
        )
    settings = get_settings()
    target = await inference.resolve_model(tenant_id=tenant.id, model=body.model, settings=settings)
    request_id = inference.new_request_id()
    warning = random_weights_warning(target.base)
    completion = inference.Completion(settings, worker_request(body, target, request_id))
    await completion.submit()
    created = int(time.time())
    events = completion.events()
    try:
        first = await anext(events)  # "start" or "loading" (or an error, raised here as an HTTP error)
    except BaseException:
        await completion.close()
        raise
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        head = ChunkHead(warning, loading_notice(target.base) if first["type"] == "loading" else None)
        chunks = sse_chunks(completion, events, body.model, created, include_usage, head)
        return StreamingResponse(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    try:
        done = start = first
        async for event in events:
            start = event if event["type"] == "start" else start
            done = event
    finally:
        await completion.close()
    load_seconds = start.get("load_seconds")
    return ChatCompletion(
        id=request_id,
        created=created,
        model=body.model,
        choices=[
            Choice(
                message=AssistantMessage(content=done["text"], tool_calls=done.get("tool_calls") or None),
                finish_reason=done["finish_reason"],
                logprobs=_logprobs(done),
            )
        ],
        usage=usage_of(done),
        warning=warning,
        notice=loaded_notice(target.base, load_seconds) if load_seconds is not None else None,
    )


async def sse_chunks(
    completion: inference.Completion,
    events: AsyncIterator[dict[str, Any]],
    model: str,
    created: int,
    include_usage: bool,
    head: ChunkHead,
) -> AsyncIterator[str]:
    """OpenAI's stream: a role chunk, content chunks, a chunk with the finish reason, with
    `stream_options.include_usage` a last chunk with no choices and the usage, then [DONE]. A
    model that is loading first is announced by an SSE comment (clients skip it) before that."""

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None, first: bool = False) -> str:
        extra = {"warning": head.warning, "notice": head.notice} if first else {}
        body = ChatCompletionChunk(
            id=completion.id, created=created, model=model, choices=choices, usage=usage, **extra
        )
        # as OpenAI: with include_usage every chunk has "usage" (null until the last one);
        # without it the field is absent. Loraq's warning and notice: on the first chunk, if set
        omit = {name for name in ("warning", "notice") if not extra.get(name)}
        if not include_usage:
            omit.add("usage")
        return f"data: {body.model_dump_json(exclude_none=False, exclude=omit)}\n\n"

    try:
        if head.notice:
            yield f": {head.notice}\n\n"
        yield chunk([ChunkChoice(delta=ChunkDelta(role="assistant", content=""))], first=True)
        sent = 0  # tokens whose logprobs a chunk carried
        async for event in events:
            if event["type"] == "delta" and event["text"]:
                logprobs = _logprobs(event)
                sent += len(logprobs.content or []) if logprobs else 0
                yield chunk([ChunkChoice(delta=ChunkDelta(content=event["text"]), logprobs=logprobs)])
            elif event["type"] == "done":
                for delta in answer_deltas(event):
                    yield chunk([ChunkChoice(delta=delta)])
                # tokens whose text never came (held back, or decoding to nothing) end the stream
                rest = {"logprobs": event["logprobs"][sent:]} if event.get("logprobs") is not None else {}
                last = _logprobs(rest) if rest.get("logprobs") else None
                yield chunk(
                    [ChunkChoice(delta=ChunkDelta(), finish_reason=event["finish_reason"], logprobs=last)]
                )
                if include_usage:
                    yield chunk([], usage_of(event))
        yield "data: [DONE]\n\n"
    except LoraqError as exc:  # the status line is sent: the error goes in the stream, as OpenAI does
        yield f"data: {json.dumps(error_body(exc.message, exc.type, exc.param, exc.code))}\n\n"
    finally:
        await completion.close()
