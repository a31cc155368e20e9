"""Every model family from the Hub to a served adapter, through the real processes (issue 31):
each tiny family of tests/engine/tiny_families.py is published on the suite's own Hub
(tests/fake_hub.py) and named by its Hub id in a job submitted to the API; the Celery worker
pulls it through huggingface_hub (the download's progress in the job's events), trains and exports
the adapter; the adapter downloaded through the API loads in PEFT on the family's transformers
model, and `/v1/chat/completions` (an inference worker) answers with `logprobs` that are PEFT's log
softmax at the first generated position, top tokens and values, within 1e-4.

One SQLite stack for the module (the job flow on PostgreSQL is covered by test_job_flow): the
queue-to-worker path is the same for every family; what differs is the model."""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from tests.e2e.datasets import chat_lines
from tests.e2e.procs import Service, running_service
from tests.engine.tiny_families import save_tiny_family
from tests.fake_hub import FakeHub, running_hub
from worker.engine.families import FAMILIES

pytestmark = [pytest.mark.slow]

# ~2 to 2.5 min on the busy 2-core machine, mostly starting the API, the worker and the inference
# worker (two families took 117 s, all six 145 s): every family goes through
FULL_STACK = list(FAMILIES)
QUESTION = "What is the sea like today, and where do the fish swim?"
TOP = 5


@dataclass
class Stack:
    service: Service
    hub: FakeHub
    sources: dict[str, Path]  # architecture -> the published directory
    jobs: dict[str, dict[str, Any]]  # architecture -> its succeeded job


def repo_id(architecture: str) -> str:
    return f"tiny-families/{architecture.removesuffix('ForCausalLM').lower()}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Stack]:
    """The stack, every family's job submitted at once (the worker runs them one after another)."""
    tmp = tmp_path_factory.mktemp("hub-families")
    with running_hub() as hub:
        sources = {a: save_tiny_family(a, tmp / "published" / a) for a in FULL_STACK}
        for architecture, directory in sources.items():
            hub.publish_dir(repo_id(architecture), directory)
        db = f"sqlite:///{tmp / 'loraq.db'}"
        with running_service(tmp / "service", db, redis_url, HF_ENDPOINT=hub.url) as service:
            service.start_inference()
            client = openai.OpenAI(base_url=service.url + "/v1", api_key=service.key, max_retries=0)
            file = client.files.create(file=("train.jsonl", chat_lines(8)), purpose="fine-tune")
            submitted = {
                architecture: client.fine_tuning.jobs.create(
                    model=repo_id(architecture),
                    training_file=file.id,
                    seed=3,
                    hyperparameters={"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 20.0},
                    extra_body={"lora": {"r": 4, "alpha": 8}, "max_seq_len": 128},
                )
                for architecture in FULL_STACK
            }
            jobs = {a: service.wait_job(j.id, {"succeeded"}, timeout=600) for a, j in submitted.items()}
            yield Stack(service, hub, sources, jobs)


def events(service: Service, job_id: str) -> list[str]:
    with service.client() as c:
        data = c.get(f"/fine_tuning/jobs/{job_id}/events", params={"limit": 1000}).json()["data"]
    return [e["message"] for e in reversed(data)]


@pytest.mark.parametrize("architecture", FULL_STACK)
def test_a_hub_family_trains_and_serves_what_peft_computes(
    stack: Stack, architecture: str, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.engine.data import prompt_ids

    job, repo = stack.jobs[architecture], repo_id(architecture)
    said = events(stack.service, job["id"])
    start = next(i for i, m in enumerate(said) if m.startswith(f"Downloading base model {repo} ("))
    assert f"from {stack.hub.url}" in said[start]
    progress = [m for m in said if m.startswith(f"Downloading base model {repo}: ")]
    assert progress and progress[-1].endswith(" of 0 MB")  # the tiny weights: 0.1-0.2 MB
    verified = said.index(f"Base model {repo}: every file matches the Hub's digests; the model is local")
    assert start < verified
    assert len(stack.hub.downloads(repo, "model.safetensors")) == 1  # one download for the job

    with stack.service.client() as c:
        zipped = c.get(f"/fine_tuning/jobs/{job['id']}/adapter")
        listed = c.get(f"/models/{repo}").json()
    assert zipped.status_code == 200
    assert (listed["kind"], listed["family"], listed["local"]) == ("hub", FAMILIES[architecture].name, True)
    zipfile.ZipFile(io.BytesIO(zipped.content)).extractall(tmp_path / "adapter")
    source = stack.sources[architecture]
    base: Any = AutoModelForCausalLM.from_pretrained(source)
    model: Any = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    messages = [{"role": "user", "content": QUESTION}]
    ids = prompt_ids(messages, tokenizer)
    with torch.no_grad():
        want = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
        with model.disable_adapter():
            plain = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].double(), dim=-1)
    assert (want - plain).abs().max() > 1e-2  # the adapter changes the first token's distribution

    client = openai.OpenAI(base_url=stack.service.url + "/v1", api_key=stack.service.key, max_retries=0)
    reply = client.chat.completions.create(
        model=job["fine_tuned_model"],
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
        temperature=0,
        logprobs=True,
        top_logprobs=TOP,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].logprobs is not None and reply.choices[0].logprobs.content is not None
    (first,) = reply.choices[0].logprobs.content
    values, top_ids = want.topk(TOP)
    assert [t.token for t in first.top_logprobs] == [tokenizer.decode([i]) for i in top_ids.tolist()]
    for got, expected in zip(first.top_logprobs, values.tolist(), strict=True):
        assert math.isclose(got.logprob, expected, abs_tol=1e-4), (got, expected)
    # greedy: the answer is PEFT's argmax, with its log-probability
    assert first.token == tokenizer.decode([int(want.argmax())])
    assert math.isclose(first.logprob, float(want.max()), abs_tol=1e-4)
    assert first.bytes == list(first.token.encode())

    # a stream's chunks carry the same logprobs, token by token, as the whole answer's
    ask: dict[str, Any] = {
        "model": job["fine_tuned_model"], "messages": messages, "max_tokens": 6, "temperature": 0,
        "logprobs": True, "top_logprobs": 2,
    }  # fmt: skip
    whole = client.chat.completions.create(**ask)
    assert whole.choices[0].logprobs is not None and whole.choices[0].logprobs.content is not None
    streamed = [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
        for chunk in client.chat.completions.create(**ask, stream=True)
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
        for t in chunk.choices[0].logprobs.content
    ]
    expected = [
        (t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
        for t in whole.choices[0].logprobs.content
    ]
    assert streamed == expected and len(expected) == whole.usage.completion_tokens
