"""`POST /v1/chat/completions` against the real processes (API, Celery worker, `loraq inference`),
driven by the official `openai` package, unmodified, streaming and not.

A tiny-llama job is trained first; its `fine_tuned_model`, a checkpoint's model and the base are
then asked for completions. The fine-tuned model's greedy answers must equal what transformers +
PEFT generate from the adapter zip downloaded through the API, token for token.
"""

from __future__ import annotations

import io
import json
import secrets
import zipfile
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.datasets import QUESTIONS, chat_lines
from tests.e2e.procs import Service

PIRATE = "Answer like a pirate."


@pytest.fixture(scope="module")
def trained(service: Service) -> dict[str, Any]:
    """A succeeded tiny-llama job of a tenant of its own, and that tenant's key."""
    service.start_inference()
    key = service.new_key(f"chat-{secrets.token_hex(4)}")
    client = openai.OpenAI(base_url=service.url + "/v1", api_key=key, max_retries=0)
    f = client.files.create(file=("train.jsonl", chat_lines(16)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        suffix="chat",
        seed=1,
        hyperparameters={"n_epochs": 6, "batch_size": 4, "learning_rate_multiplier": 20.0},
        # unpacked: 24 steps of 4 examples, enough for the marker "ARRR!" to be learned
        extra_body={"lora": {"r": 8, "alpha": 16}, "max_seq_len": 128, "packing": False},
    )
    done = service.wait_job(job.id, {"succeeded"}, key=key)
    return {"key": key, "job": done}


def oai(service: Service, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=service.url + "/v1", api_key=key, max_retries=0, timeout=60)


def ask(question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": PIRATE}, {"role": "user", "content": question}]


def test_openai_client_non_streamed_and_streamed(e2e: Service, trained: dict[str, Any]) -> None:
    client = oai(e2e, trained["key"])
    model = trained["job"]["fine_tuned_model"]
    reply = client.chat.completions.create(
        model=model, messages=ask(QUESTIONS[0]), max_tokens=16, temperature=0
    )
    assert reply.object == "chat.completion" and reply.model == model and reply.id.startswith("chatcmpl-")
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in {"stop", "length"}
    assert "ARRR" in (choice.message.content or "")  # it learned the dataset's marker
    assert reply.usage is not None and reply.usage.prompt_tokens > 10
    assert 0 < reply.usage.completion_tokens <= 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens

    stream = client.chat.completions.create(
        model=model,
        messages=ask(QUESTIONS[0]),
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: the same answer, streamed
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # in pieces
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == reply.usage


def sse_lines(e2e: Service, key: str, **extra: Any) -> list[str]:
    body = {"model": "tiny-llama", "messages": ask("hi"), "max_tokens": 4, "stream": True, "seed": 3}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream(
        "POST", e2e.url + "/v1/chat/completions", json=body | extra, headers=headers, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return lines


def test_sse_wire_format_ends_with_done(e2e: Service, trained: dict[str, Any]) -> None:
    lines = sse_lines(e2e, trained["key"])
    assert '"finish_reason":"length"' in lines[-2]
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("usage" not in c for c in chunks)  # OpenAI sends no usage field unless asked

    lines = sse_lines(e2e, trained["key"], stream_options={"include_usage": True})
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])  # present, null, on every other chunk
    last = chunks[-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4


def test_base_checkpoint_and_fine_tuned_models_answer(e2e: Service, trained: dict[str, Any]) -> None:
    client = oai(e2e, trained["key"])
    job = trained["job"]
    ckpts = list(client.fine_tuning.jobs.checkpoints.list(job["id"]))
    assert ckpts
    answers = {}
    for model in ("tiny-llama", ckpts[-1].fine_tuned_model_checkpoint, job["fine_tuned_model"]):
        r = client.chat.completions.create(
            model=model, messages=ask(QUESTIONS[2]), max_tokens=12, temperature=0
        )
        answers[model] = r.choices[0].message.content
    assert answers["tiny-llama"] != answers[job["fine_tuned_model"]]


def test_tenancy_and_errors_use_openai_bodies(e2e: Service, trained: dict[str, Any]) -> None:
    model = trained["job"]["fine_tuned_model"]
    stranger = oai(e2e, e2e.new_key(f"stranger-{secrets.token_hex(4)}"))
    with pytest.raises(openai.NotFoundError) as other:
        stranger.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2)
    assert other.value.code == "model_not_found" and other.value.body["param"] == "model"  # type: ignore[index]

    client = oai(e2e, trained["key"])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="ft:tiny-llama:chat:ftjob-nope", messages=ask("hi"))
    with pytest.raises(openai.BadRequestError) as n2:
        client.chat.completions.create(model=model, messages=ask("hi"), n=2)
    assert n2.value.body["param"] == "n"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=5000)
    assert long.value.body["param"] == "messages" and "context length" in long.value.message  # type: ignore[index]


def test_greedy_output_equals_transformers_peft_on_the_downloaded_adapter(
    e2e: Service, trained: dict[str, Any], tmp_path: Path
) -> None:
    import torch
    from peft import PeftModel

    from worker.engine.data import prompt_ids
    from worker.engine.tiny import build_tiny_llama

    job = trained["job"]
    with e2e.client(trained["key"]) as c:
        zipped = c.get(f"/fine_tuning/jobs/{job['id']}/adapter")
    assert zipped.status_code == 200
    zipfile.ZipFile(io.BytesIO(zipped.content)).extractall(tmp_path / "adapter")
    base, tokenizer = build_tiny_llama()
    peft_model = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()

    client = oai(e2e, trained["key"])
    for question in [*QUESTIONS[:4], "Tell me something new about the sea."]:
        # the same conversation as ask(question), as the engine takes it
        messages = [{"role": "system", "content": PIRATE}, {"role": "user", "content": question}]
        ids = prompt_ids(messages, tokenizer)
        out = peft_model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=20,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(ids) :].tolist()
        if tokenizer.eos_token_id in out:
            out = out[: out.index(tokenizer.eos_token_id)]
        reply = client.chat.completions.create(
            model=job["fine_tuned_model"], messages=ask(question), max_tokens=20, temperature=0
        )
        assert reply.choices[0].message.content == tokenizer.decode(out, skip_special_tokens=True), question
        assert reply.usage is not None and reply.usage.completion_tokens == len(out)
        assert reply.usage.prompt_tokens == len(ids)


def test_time_to_first_token_and_tokens_per_second_are_prometheus_metrics(
    e2e: Service, trained: dict[str, Any]
) -> None:
    client = oai(e2e, trained["key"])
    client.chat.completions.create(model="tiny-llama", messages=ask("hi"), max_tokens=8, temperature=0)
    port = e2e.env["LORAQ_INFERENCE_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    samples = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if not line.startswith("#")
    }
    assert samples['loraq_inference_time_to_first_token_seconds_count{model="tiny-llama"}'] >= 1
    assert samples['loraq_inference_tokens_per_second_count{model="tiny-llama"}'] >= 1
    assert samples['loraq_inference_generated_tokens_total{model="tiny-llama"}'] >= 8
    assert samples['loraq_inference_requests_total{outcome="ok"}'] >= 1


def test_a_model_loading_first_says_so_and_random_weights_warn(e2e: Service, trained: dict[str, Any]) -> None:
    """smollm2-135m (random weights, one word from smollm2-135m-instruct) is not preloaded: the
    first streamed request on it says at once that it is loading (an SSE comment, which clients
    skip, and `notice` on the first chunk), and the worker logs it; every answer on it carries the
    random-weights warning naming the real model."""
    body = {"model": "smollm2-135m", "messages": ask("hi"), "max_tokens": 2, "stream": True}
    headers = {"Authorization": f"Bearer {trained['key']}"}
    with httpx.stream("POST", e2e.url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[0].startswith(": smollm2-135m is loading on the inference worker (the first request"), lines
    first, *rest = [json.loads(line.removeprefix("data: ")) for line in lines[1:-1]]
    assert first["choices"][0]["delta"]["role"] == "assistant" and first["notice"] == lines[0][2:]
    assert first["warning"].startswith("smollm2-135m has random weights (for benchmarks only)")
    assert first["warning"].endswith("; did you mean smollm2-135m-instruct?")
    assert rest and all("warning" not in c and "notice" not in c for c in rest)  # the first chunk only
    assert lines[-1] == "data: [DONE]"
    assert "loading base model smollm2-135m for 1 chat request(s)" in e2e.log_text("inference")

    loaded = httpx.post(
        e2e.url + "/v1/chat/completions", json=body | {"stream": False}, headers=headers, timeout=60
    )
    assert loaded.json()["notice"] is None and loaded.json()["warning"] == first["warning"]
