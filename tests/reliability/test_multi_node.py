"""One job across two hosts (`n_nodes: 2`), on CPU with gloo: two Celery workers, each in a network
namespace of its own (tests/netns.py) with a data directory of its own, that reach Redis,
PostgreSQL and the S3 server (moto) only, and each other over a direct link (the rendezvous and
the collectives' ports). The API, the database and the bucket are on this machine's side.

- The two hosts train the loss curve that one host trains on the same global batch (one worker,
  n_nodes 1, same seed and data): every step's loss to fp32 summation order, as the one-host
  ranks do (tests/deploy/test_distributed.py).
- One host loses power mid-job (every process in its namespace SIGKILLed, its worker, torchrun and
  ranks at once): the other host's ranks fail their next collective, its worker ends the attempt
  and says so in the job's events, the job goes back to the queue; once a worker is back on the
  lost host, the two resume it from its last checkpoint and it succeeds, each step stored once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.netns import Host, Link, isolated_host, kill_host, linked
from tests.reliability.conftest import CHECKPOINT_EVERY, Stack, running_stack
from tests.reliability.test_s3_stack import checkpoint_steps, shared_services, start_worker_on
from tests.servers import S3Server, shared_s3

pytestmark = pytest.mark.slow

JOIN_TIMEOUT_S = 120  # a replacement worker starts (imports torch) well within it


@dataclass
class TwoHosts:
    stack: Stack
    server: S3Server
    hosts: tuple[Host, Host]
    link: Link

    def start_worker(self, i: int) -> subprocess.Popen[bytes]:
        """A worker on host `i` that the other host reaches at its end of the link (the ranks'
        traffic goes over that device, as GLOO_SOCKET_IFNAME says)."""
        return start_worker_on(
            self.stack,
            self.server,
            self.hosts[i],
            LORAQ_WORKER_RENDEZVOUS_ADDRESS=self.link.addresses[i],
            GLOO_SOCKET_IFNAME=self.link.devices[i],
            LORAQ_NODE_JOIN_TIMEOUT_SECONDS=str(JOIN_TIMEOUT_S),
        )


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    server = shared_s3()
    bucket = server.new_bucket()
    # accept_unserved_jobs: the cancel test's job on 3 hosts waits for a third worker that never comes
    env = {**server.env(bucket), "LORAQ_ACCEPT_UNSERVED_JOBS": "1"}
    with running_stack(tmp_path_factory.mktemp("multinode"), **env) as stack:
        forward = shared_services(stack, server)
        with isolated_host(forward) as first, isolated_host(forward) as second, linked(first, second) as link:
            hosts = TwoHosts(stack, server, (first, second), link)
            hosts.start_worker(0)
            hosts.start_worker(1)
            yield hosts


def submit(stack: Stack, *, n_nodes: int, n_epochs: int) -> str:
    body = {
        "model": "tiny-llama",
        "training_file": stack.file_id,  # 16 examples: 4 steps an epoch of 4
        "suffix": "rel",
        "seed": 7,
        "hyperparameters": {"n_epochs": n_epochs, "batch_size": 4, "learning_rate_multiplier": 2.0},
        "lora": {"r": 4, "alpha": 8},
        "max_seq_len": 128,
        "packing": False,
        "n_nodes": n_nodes,
    }
    with stack.client() as c:
        resp = c.post("/fine_tuning/jobs", json=body)
        assert resp.status_code == 200, resp.text
        assert resp.json()["n_nodes"] == n_nodes
        return str(resp.json()["id"])


def test_two_hosts_train_the_loss_curve_of_one(two_hosts: TwoHosts) -> None:
    stack = two_hosts.stack
    one = submit(stack, n_nodes=1, n_epochs=2)
    stack.assert_succeeded_once(one, attempts=1)
    two = submit(stack, n_nodes=2, n_epochs=2)
    job = stack.assert_succeeded_once(two, attempts=1)

    events = stack.events(two)
    assert any(e.startswith("Waiting for 1 more worker(s) of the queue to join") for e in events), events
    joined = [e for e in events if e.endswith("joined the job's 2 hosts")]
    assert len(joined) == 1 and job["worker_id"] not in joined[0], (joined, job["worker_id"])
    alone, together = stack.losses(one), stack.losses(two)
    assert sorted(together) == sorted(alone) == list(range(1, 9))
    for step, loss in alone.items():
        assert together[step] == pytest.approx(loss, rel=1e-5), (step, together, alone)


def test_a_lost_host_fails_the_attempt_and_the_job_resumes(two_hosts: TwoHosts) -> None:
    stack = two_hosts.stack
    job_id = submit(stack, n_nodes=2, n_epochs=6)  # 24 steps, a checkpoint every 3
    stack.wait(job_id, {"running"})
    stack.wait_checkpoint(job_id)
    # the host of the worker that claimed the job: it serves the rendezvous's store
    claimer = int(stack.job(job_id)["worker_id"].rsplit(":", 1)[1])
    lost = next(i for i in (0, 1) if str(claimer) in pids_on(two_hosts.hosts[i]))
    kill_host(two_hosts.hosts[lost])

    requeued = wait_event(stack, job_id, "Job re-queued: a host of the job's 2 failed")
    assert "(attempt 1 of 3); it resumes from its last checkpoint" in requeued, requeued
    assert two_hosts.link.addresses[lost] in requeued, requeued  # the lost host, by its address
    # the last registered one: the surviving host may have saved one more as its ranks stopped
    saved = max(checkpoint_steps(stack, job_id))
    assert saved % CHECKPOINT_EVERY == 0
    two_hosts.start_worker(lost)  # the lost host is back (its data directory as it was)
    stack.assert_succeeded_once(job_id, attempts=2)
    events = stack.events(job_id)
    assert f"Resuming from the checkpoint at step {saved}" in events, events


def test_a_killed_rank_fails_the_attempt_and_the_same_workers_resume_it(two_hosts: TwoHosts) -> None:
    """One rank process SIGKILLed (its worker and torchrun live on): both hosts' workers see the
    attempt fail, one ends it, and the two take the job again and resume it."""
    stack = two_hosts.stack
    job_id = submit(stack, n_nodes=2, n_epochs=6)
    stack.wait(job_id, {"running"})
    stack.wait_checkpoint(job_id)
    ranks = [pid for host in two_hosts.hosts for pid in pids_on(host) if is_rank(pid)]
    assert len(ranks) == 2, ranks  # one rank a host (n_gpus 1)
    os.kill(int(ranks[1]), signal.SIGKILL)

    requeued = wait_event(stack, job_id, "Job re-queued: a host of the job's 2 failed")
    assert "(attempt 1 of 3); it resumes from its last checkpoint" in requeued, requeued
    saved = max(checkpoint_steps(stack, job_id))
    stack.assert_succeeded_once(job_id, attempts=2)
    events = stack.events(job_id)
    assert f"Resuming from the checkpoint at step {saved}" in events, events


def is_rank(pid: str) -> bool:
    """Whether `pid` is a torchrun rank (`python -m worker.engine.distributed ...`), not its agent."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # ended meanwhile
        return False
    return b"worker.engine.distributed" in argv and b"torch.distributed.run" not in argv


def pids_on(host: Host) -> set[str]:
    out = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def wait_event(stack: Stack, job_id: str, prefix: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in stack.events(job_id) if e.startswith(prefix)]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no event {prefix!r} for job {job_id}: {stack.events(job_id)}\n{stack.logs()}")


def test_a_cancel_reaches_hosts_still_gathering(two_hosts: TwoHosts) -> None:
    """A job on 3 hosts with 2 workers: one joins, the third never comes. A cancel ends it at once
    (the first worker stops waiting), not at the join timeout."""
    stack = two_hosts.stack
    job_id = submit(stack, n_nodes=3, n_epochs=1)
    wait_event(stack, job_id, "Worker ")  # "Worker <id> joined the job's 3 hosts"
    with stack.client() as c:
        assert c.post(f"/fine_tuning/jobs/{job_id}/cancel").status_code == 200
    stack.wait(job_id, {"cancelled"}, timeout=JOIN_TIMEOUT_S / 2)
    events = stack.events(job_id)
    assert "Fine-tuning job cancelled" in events and not [e for e in events if "re-queued" in e], events
