"""The `validating_files` stage: a job waits there while its files' token counts are computed.

A submit checks `max_seq_len` against the token lengths of the job's files
(service/token_lengths.py). Where they are stored already, or the submit can count them within
`submit_count_seconds` (most files), the check is synchronous: a 400 naming `max_seq_len`, or the
job goes straight to `queued`. A larger file (up to the 512 MB an upload accepts: minutes of
tokenizing) would hold the request that long, so its job is accepted in `validating_files`
instead, as OpenAI's jobs are, and counted by a process of its own (`python -m
service.file_validation JOB_ID`, niced: neither the API's threads nor its memory pay for it):

1. each of the job's files without stored counts is counted under the file's counting lock (a
   second process for the same file waits, then finds the counts stored) and the counts stored;
2. every job waiting on those files is settled (`settle`): `failed` with the error a submit
   answers (code `max_seq_len_too_short`, param `max_seq_len`), or `queued` with the events a
   submit writes, and enqueued.

The reaper (`tick`, from service/reaper.py) settles a waiting job whose counts exist and counts
again where no process holds the lock (the API restarted, the counter was killed); a count that
failed `MAX_STARTS` times leaves the check to the worker, which validates every line anyway.
A job cancelled while it validates ends `cancelled` at once (jobs.request_cancel); settling
leaves it alone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from service import jobs
from service.db.models import File, Job
from service.db.session import session_scope
from service.queue import enqueue_job, job_queue
from service.token_lengths import count, counter_for, counting, stored, too_long_message

if TYPE_CHECKING:
    from service.token_lengths import TokenCounter

log = logging.getLogger("loraq.file_validation")

MAX_STARTS = 3  # counts of one job started by this process before the check is left to the worker
# A job this young may still have its first counter starting: the reaper leaves it to that one.
START_GRACE_S = 10
NICENESS = 10

_children: dict[str, subprocess.Popen[bytes]] = {}  # job id -> its counting process
_starts: dict[str, int] = {}
_children_lock = threading.Lock()


# ---------------------------------------------------------------- in the API process


def start(job_id: str) -> None:
    """Count the job's files and settle it, in a process of its own; returns at once."""
    with _children_lock:
        for done in [j for j, c in _children.items() if c.poll() is not None]:
            del _children[done]  # reaped
        if job_id in _children:
            return
        _starts[job_id] = _starts.get(job_id, 0) + 1
        child = subprocess.Popen(
            [sys.executable, "-m", "service.file_validation", job_id], stdin=subprocess.DEVNULL
        )
        _children[job_id] = child
    log.info("job %s: counting the tokens of its files (pid %d)", job_id, child.pid)


def stop_children(timeout: float = 5.0) -> None:
    """The API is stopping: end its counting processes (the next start's reaper counts again)."""
    with _children_lock:
        children = list(_children.values())
        _children.clear()
    for child in children:
        child.terminate()
    for child in children:
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def tick(now: float | None = None) -> list[str]:
    """The reaper's part: settle each waiting job whose counts exist (queued ones are enqueued),
    count again for one that no process counts. Returns the ids of the jobs settled."""
    from service.token_lengths import being_counted

    now = time.time() if now is None else now
    with session_scope() as session:
        waiting = list(
            session.scalars(
                select(Job.id).where(Job.status == "validating_files", Job.created_at <= now - START_GRACE_S)
            )
        )
    settled: list[str] = []
    for job_id in waiting:
        if settle_and_enqueue(job_id):
            settled.append(job_id)
            continue
        with session_scope() as session:
            missing = _missing_counts(session, job_id)
        if not missing or any(being_counted(file, counter) for file, counter in missing):
            continue  # no longer waiting, or being counted
        if _starts.get(job_id, 0) < MAX_STARTS:
            log.warning("job %s: no process counts its files; counting again", job_id)
            start(job_id)
            continue
        unchecked = f"its token count was started {MAX_STARTS} times and did not finish"
        if settle_and_enqueue(job_id, unchecked=unchecked):
            settled.append(job_id)
    return settled


# ---------------------------------------------------------------- settling a waiting job


def _files_of(session: Session, job: Job) -> list[tuple[File, str]]:
    """(file, param) of the job's training file and validation file, if any."""
    out = []
    for file_id, param in ((job.training_file, "training_file"), (job.validation_file, "validation_file")):
        file = session.scalar(select(File).where(File.id == file_id)) if file_id else None
        if file is not None:
            out.append((file, param))
    return out


def _missing_counts(session: Session, job_id: str) -> list[tuple[File, TokenCounter]]:
    job = session.scalar(select(Job).where(Job.id == job_id))
    if job is None or job.status != "validating_files":
        return []
    counter = counter_for(job.model)
    if counter is None:
        return []
    return [(file, counter) for file, _ in _files_of(session, job) if stored(file, counter) is None]


def settle(session: Session, job_id: str, *, unchecked: str | None = None) -> str | None:
    """Move waiting job `job_id` on once every count of its files exists: "failed" (examples over
    its max_seq_len: the submit's error), "queued" (the caller commits, then enqueues), or None
    (still counting, or the job is no longer waiting). `unchecked`: why the counts will not come;
    the job is queued and the worker's validation checks the lengths."""
    job = session.scalar(select(Job).where(Job.id == job_id))
    if job is None or job.status != "validating_files":
        return None
    counter = counter_for(job.model)
    for file, param in _files_of(session, job) if counter is not None and unchecked is None else []:
        assert counter is not None
        found = stored(file, counter)
        if found is None:
            return None
        message = too_long_message(param, found, job.max_seq_len)
        if message is not None:
            error = {"code": jobs.MAX_SEQ_LEN_TOO_SHORT, "message": message, "param": "max_seq_len"}
            return "failed" if jobs.files_refused(session, job_id=job_id, error=error) else None
    if unchecked is not None:
        message = (
            f"The token lengths of the job's files were not checked ({unchecked}); the worker checks them"
        )
        jobs.add_event(session, job_id=job_id, level="warn", message=message)
    ok = jobs.files_validated(session, job_id=job_id, model=job.model, waiting_for=job.waiting_for)
    return "queued" if ok else None


def settle_and_enqueue(job_id: str, *, unchecked: str | None = None) -> str | None:
    """`settle` in a transaction of its own; a queued job is enqueued once that is committed."""
    with session_scope() as session:
        outcome = settle(session, job_id, unchecked=unchecked)
        job = session.scalar(select(Job).where(Job.id == job_id))
        queue = job_queue(job) if job is not None else None
    if outcome == "queued":
        enqueue_job(job_id, queue=queue)
    return outcome


# ---------------------------------------------------------------- the counting process


def count_and_settle(job_id: str) -> None:
    """Count the job's files that have no stored counts, then settle every job waiting on them."""
    with session_scope() as session:
        job = session.scalar(select(Job).where(Job.id == job_id))
        if job is None or job.status != "validating_files":
            return
        model = job.model
        files = [file for file, _ in _files_of(session, job)]
        session.expunge_all()  # read after the session ends (a count takes minutes: no open transaction)
    counter = counter_for(model)
    unchecked = None
    try:
        for file in files if counter is not None else []:
            assert counter is not None
            _count_once(file, counter)
    except Exception as e:  # the worker validates every line anyway: the job must not wait forever
        log.exception("job %s: counting the tokens of its files failed", job_id)
        unchecked = f"counting them failed: {type(e).__name__}"
    ids = [file.id for file in files]
    with session_scope() as session:
        waiting = list(
            session.scalars(
                select(Job.id).where(
                    Job.status == "validating_files",
                    or_(Job.training_file.in_(ids), Job.validation_file.in_(ids)),
                )
            )
        )
    settle_and_enqueue(job_id, unchecked=unchecked)
    for other in waiting:  # jobs submitted on the same files meanwhile
        if other != job_id:
            settle_and_enqueue(other)


def _count_once(file: File, counter: TokenCounter) -> None:
    if stored(file, counter) is not None:
        return
    with counting(file, counter):
        if stored(file, counter) is not None:  # another process counted it while this one waited
            return
        started = time.monotonic()
        found = count(file, counter)
        assert found is not None
    seconds = time.monotonic() - started
    log.info("file %s: %d examples counted in %.1fs", file.id, len(found.tokens), seconds)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.nice(NICENESS)  # the API and the workers on this host come first
    (job_id,) = argv
    count_and_settle(job_id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
