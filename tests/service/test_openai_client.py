"""The official `openai` package, unmodified, against the app (in-process over ASGI): files,
fine-tuning jobs, events, checkpoints, cancel, models and typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from service.app import create_app
from tests.conftest import DATASET, ApiClient
from tests.service.test_api_jobs import run_job_to_success


@asynccontextmanager
async def asgi_openai(api_key: str) -> AsyncIterator[openai.AsyncOpenAI]:
    """The official client, unmodified, on the app in process (over ASGI)."""
    transport = httpx.ASGITransport(app=create_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://loraq.test") as http:
        # openai 3 annotates http_client as httpx2's AsyncClient but accepts httpx's too (the
        # legacy client), which is what serves an ASGI app in process here
        yield openai.AsyncOpenAI(
            base_url="http://loraq.test/v1",
            api_key=api_key,
            http_client=http,  # type: ignore[arg-type]
            max_retries=0,
        )


async def flow(api: ApiClient) -> dict[str, Any]:
    async with asgi_openai(api.key) as client:
        f = await client.files.create(file=("train.jsonl", DATASET), purpose="fine-tune")
        assert f.id.startswith("file-") and f.bytes == len(DATASET) and f.purpose == "fine-tune"
        assert (await client.files.retrieve(f.id)).filename == "train.jsonl"
        assert (await client.files.content(f.id)).content == DATASET
        assert [x.id async for x in client.files.list()] == [f.id]

        job = await client.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=f.id,
            suffix="t",
            seed=3,
            hyperparameters={"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": 1.5},
            extra_body={"lora": {"r": 4, "alpha": 8}, "max_seq_len": 64},
        )
        assert job.status == "queued" and job.model == "tiny-llama" and job.seed == 3
        assert (
            job.hyperparameters.n_epochs == 2 and job.method is not None and job.method.type == "supervised"
        )
        other = await client.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
        listed = [j.id async for j in client.fine_tuning.jobs.list(limit=1)]  # auto-paginates via `after`
        assert listed == [other.id, job.id]
        cancelled = await client.fine_tuning.jobs.cancel(other.id)
        assert cancelled.status == "cancelled"

        await asyncio.to_thread(run_job_to_success, api, job.id)
        done = await client.fine_tuning.jobs.retrieve(job.id)
        assert done.status == "succeeded" and done.fine_tuned_model == f"ft:tiny-llama:t:{job.id}"
        assert done.trained_tokens == 300 and len(done.result_files) == 1
        events = [e async for e in client.fine_tuning.jobs.list_events(job.id, limit=2)]
        assert {e.type for e in events} == {"message", "metrics"}
        assert sorted(e.data["step"] for e in events if e.type == "metrics") == [1, 2, 3]  # type: ignore[index]
        ckpts = [c async for c in client.fine_tuning.jobs.checkpoints.list(job.id)]
        assert [c.step_number for c in ckpts] == [2] and ckpts[0].fine_tuning_job_id == job.id
        models = [m.id async for m in client.models.list()]
        assert "tiny-llama" in models and done.fine_tuned_model in models
        assert (await client.models.retrieve(done.fine_tuned_model or "")).owned_by == api.tenant_id
        csv_text = (await client.files.content(done.result_files[0])).text
        assert (
            csv_text.splitlines()[0] == "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy"
        )

        errors: dict[str, Any] = {}
        with pytest.raises(openai.BadRequestError) as bad:
            await client.fine_tuning.jobs.create(
                model="tiny-llama", training_file=f.id, hyperparameters={"n_epochs": 0}
            )
        errors["bad"] = bad.value
        with pytest.raises(openai.NotFoundError) as missing:
            await client.fine_tuning.jobs.retrieve("ftjob-nope")
        errors["missing"] = missing.value
        async with asgi_openai("sk-wrong") as wrong:
            with pytest.raises(openai.AuthenticationError) as unauth:
                await wrong.fine_tuning.jobs.list()
        errors["unauth"] = unauth.value
        deleted = await client.files.delete(done.result_files[0])
        assert deleted.deleted is True
        return errors


def test_openai_package_works_unmodified(api: ApiClient) -> None:
    errors = asyncio.run(flow(api))
    assert errors["bad"].param == "hyperparameters.n_epochs"
    assert errors["bad"].status_code == 400
    assert errors["missing"].status_code == 404
    assert errors["unauth"].status_code == 401 and errors["unauth"].code == "invalid_api_key"
