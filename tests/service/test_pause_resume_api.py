"""Pause, resume, `estimated_finish`, `metadata` and `integrations` through the official `openai`
package, unmodified, against the app in process; the worker's side through the state machine
(tests/worker/test_pause.py runs a real one)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest

from service import jobs
from service.db.session import session_scope
from tests.conftest import DATASET, ApiClient
from tests.service.test_jobs_state import step
from tests.service.test_openai_client import asgi_openai

METADATA = {"team": "pirates", "k" * 64: "v" * 512, **{f"key{i}": str(i) for i in range(14)}}  # 16 keys
WANDB: dict[str, Any] = {"project": "loraq", "name": "pirate-run", "entity": "crew", "tags": ["arr"]}


async def pause_resume_flow(api: ApiClient) -> None:
    async with asgi_openai(api.key) as client:
        f = await client.files.create(file=("train.jsonl", DATASET), purpose="fine-tune")
        job = await client.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=f.id,
            metadata=METADATA,
            integrations=[{"type": "wandb", "wandb": WANDB}],  # type: ignore[typeddict-item]
        )
        assert job.metadata == METADATA and job.estimated_finish is None
        assert job.integrations is not None and job.integrations[0].type == "wandb"
        assert job.integrations[0].wandb.model_dump() == WANDB

        # queued: paused at once; resume queues it again
        paused = await client.fine_tuning.jobs.pause(job.id)
        assert paused.status == "paused"
        assert (await client.fine_tuning.jobs.resume(job.id)).status == "queued"
        with pytest.raises(openai.BadRequestError) as not_paused:
            await client.fine_tuning.jobs.resume(job.id)
        assert not_paused.value.code == "invalid_job_state"

        # running: estimated_finish from the measured step time (eta 7 s after step 3 of 10)
        with session_scope() as s:
            claim = jobs.claim(s, job_id=job.id, worker_id="test-worker")
        assert claim is not None
        before = time.time()
        with session_scope() as s:
            jobs.record_metrics(s, claim=claim, rows=[step(i) for i in range(1, 4)])
        running = await client.fine_tuning.jobs.retrieve(job.id)
        assert running.status == "running" and running.estimated_finish is not None
        assert int(before) + 7 <= running.estimated_finish <= time.time() + 7 + 1

        # a pause asked of a running job: it stays running until its worker reaches the pause
        asked = await client.fine_tuning.jobs.pause(job.id)
        assert asked.status == "running" and (asked.model_extra or {})["pause_requested"] is True
        with session_scope() as s:
            assert jobs.pause(s, claim=claim, step=3)  # the worker saved step 3 and stopped
        done = await client.fine_tuning.jobs.retrieve(job.id)
        assert done.status == "paused" and done.estimated_finish is None
        events = [e.message async for e in client.fine_tuning.jobs.list_events(job.id, limit=50)]
        assert "Pause requested" in events
        assert "Fine-tuning job paused at step 3; a resume continues from its checkpoint" in events

        with pytest.raises(openai.ConflictError):  # a paused job still needs its training file
            await client.files.delete(f.id)
        resumed = await client.fine_tuning.jobs.resume(job.id)
        assert resumed.status == "queued" and resumed.metadata == METADATA
        with session_scope() as s:  # the next claim is a new attempt; the paused one was not a retry
            again = jobs.claim(s, job_id=job.id, worker_id="test-worker")
        assert again is not None and (again.attempt, again.paused_attempts) == (2, 1)

        # a cancelled job can be neither paused nor resumed
        await client.fine_tuning.jobs.cancel(job.id)
        for call in (client.fine_tuning.jobs.pause, client.fine_tuning.jobs.resume):
            with pytest.raises(openai.BadRequestError) as ended:
                await call(job.id)
            assert ended.value.code == "invalid_job_state" and ended.value.param == "fine_tuning_job_id"
        with pytest.raises(openai.NotFoundError):
            await client.fine_tuning.jobs.pause("ftjob-nope")

        # OpenAI's metadata filter on the list (`metadata[k]=v`, every pair must match)
        other = await client.fine_tuning.jobs.create(
            model="tiny-llama", training_file=f.id, metadata={"team": "navy", "key0": "0"}
        )
        assert [j.id async for j in client.fine_tuning.jobs.list(metadata={"team": "pirates"})] == [job.id]
        both = {j.id async for j in client.fine_tuning.jobs.list(metadata={"key0": "0"})}
        assert both == {job.id, other.id}
        none = [j.id async for j in client.fine_tuning.jobs.list(metadata={"team": "navy", "key1": "1"})]
        assert none == []
        with pytest.raises(openai.BadRequestError) as nul:
            await client.fine_tuning.jobs.list(metadata={"team": "pi\x00rates"})
        assert nul.value.param == "metadata[team]"

        # metadata past OpenAI's limits: 17 keys, or a value over 512 characters
        for bad, param in (({**METADATA, "one-more": "x"}, "metadata"), ({"k": "v" * 513}, "metadata.k")):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id, metadata=bad)
            assert refused.value.param == param


def test_pause_resume_metadata_and_integrations_with_the_openai_package(api: ApiClient) -> None:
    asyncio.run(pause_resume_flow(api))
