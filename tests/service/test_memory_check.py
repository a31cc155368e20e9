"""A job's memory plan against the live workers' GPUs (service/memory_check.py): a job that fits
no GPU of its queue is refused at submit (400 naming what to change), the dry run shows each GPU
size's plan, and "gguf" needs a GGUF base. The workers are registry entries in the suite's real
Redis, as worker.metrics writes them."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from service import dry_run, memory_check, worker_registry
from service.schemas import JobCreate
from service.settings import get_settings
from tests.conftest import DATASET, ApiClient, job_body
from tests.servers import shared_redis_url

GIB = 2**30


@pytest.fixture
def gpu_worker() -> Iterator[Callable[[int], str]]:
    """Registers a live worker of a queue of its own with one GPU of the given GiB; returns the queue."""
    client = redis.Redis.from_url(shared_redis_url())
    nodes: list[str] = []

    def register(gib: int) -> str:
        queue, node = f"gpu-{secrets.token_hex(3)}", f"mem-node-{secrets.token_hex(3)}"
        gpu = {"index": 0, "uuid": "GPU-x", "name": "test GPU", "memory_total_bytes": float(gib * GIB)}
        entry = {"node": node, "queue": queue, "pid": 1, "gpus": [gpu], "last_seen": time.time()}
        client.set(worker_registry.worker_key(node), json.dumps(entry), ex=60)
        nodes.append(node)
        worker_registry.forget_live_workers()  # forget the last read: the entry is new
        return queue

    yield register
    for node in nodes:
        client.delete(worker_registry.worker_key(node))
    worker_registry.forget_live_workers()


def test_a_job_that_fits_no_gpu_of_its_queue_is_refused_naming_what_to_change(
    api: ApiClient, gpu_worker: Callable[[int], str]
) -> None:
    queue = gpu_worker(12)
    file_id = api.upload(DATASET)
    body = job_body(file_id, model="llama-8b", queue=queue, max_seq_len=512)
    r = api.post("/v1/fine_tuning/jobs", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "insufficient_gpu_memory" and err["param"] == "quantization"
    assert '"quantization": "nf4"' in err["message"] and "12 GiB" in err["message"]
    # a 4-bit base fits the same GPU
    ok = api.post("/v1/fine_tuning/jobs", json={**body, "quantization": "nf4"})
    assert ok.status_code == 200, ok.text


def test_gguf_quantization_needs_a_gguf_base(api: ApiClient) -> None:
    r = api.post("/v1/fine_tuning/jobs", json=job_body(api.upload(DATASET), quantization="gguf"))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "quantization" and "not a GGUF base" in err["message"]


def test_the_dry_run_shows_the_plan_on_each_gpu_size(
    api: ApiClient, gpu_worker: Callable[[int], str]
) -> None:
    queue = gpu_worker(80)
    spec = JobCreate(model="llama-8b", training_file="file-x", queue=queue, max_seq_len=4096)
    (plan,) = dry_run._memory(spec, 8, 4096, get_settings())
    assert plan.gpu_memory_gib == 80 and plan.workers == 1 and plan.fits
    assert plan.predicted_peak_gib <= plan.limit_gib == 72.0
    # 8 rows of 4096 tokens of an 8B model do not fit an H100 as they are: the plan says how
    assert (plan.micro_batch_rows, plan.activation_checkpointing) != (None, "none")
    assert "predicted peak" in plan.plan
    # a queue whose workers have no GPU (or none live) shows no plan
    cpu = JobCreate(model="llama-8b", training_file="file-x", queue="nobody-here", max_seq_len=4096)
    assert dry_run._memory(cpu, 8, 4096, get_settings()) == []


def test_a_gpus_rows_divide_the_batch_over_every_rank_of_every_host() -> None:
    spec = JobCreate(model="llama-8b", training_file="file-x", n_gpus=2, n_nodes=2)
    assert memory_check.gpu_rows(8, spec) == 2  # 4 ranks
    assert memory_check.gpu_rows(8, spec.model_copy(update={"n_nodes": 1})) == 4
    assert memory_check.gpu_rows(3, spec) == 1  # a rank's rows round up
    assert memory_check.gpu_rows(8, spec.model_copy(update={"batch_scaling": "per_gpu"})) == 8


def test_the_dry_run_plans_a_multi_host_jobs_share_of_the_batch(
    api: ApiClient, gpu_worker: Callable[[int], str]
) -> None:
    queue = gpu_worker(80)
    one = JobCreate(model="llama-8b", training_file="file-x", queue=queue, max_seq_len=4096)
    (alone,) = dry_run._memory(one, 8, 4096, get_settings())
    (shared,) = dry_run._memory(one.model_copy(update={"n_nodes": 4}), 8, 4096, get_settings())
    # 2 rows a GPU on 4 hosts instead of 8 on one: less to hold, so less split or recomputed
    assert shared.predicted_peak_gib < alone.predicted_peak_gib or (
        (shared.micro_batch_rows, shared.activation_checkpointing)
        != (alone.micro_batch_rows, alone.activation_checkpointing)
    )
