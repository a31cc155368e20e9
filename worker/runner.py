"""The glue between a queued job in the database and the training engine.

`run_claimed_job(job_id)`:
1. claims the job (fenced queued → running; a duplicate delivery gets no claim and returns),
2. builds a `TrainConfig` from the claim (dataset files from the store, output under
   `data_dir/jobs/<id>/attempt-<n>`, resume from the last registered checkpoint),
3. runs `worker.engine.recipe.train` with `JobCallbacks`, which batch metrics into the database,
   heartbeat, register checkpoints and turn a cancel or pause request into `should_stop() == True`,
4. ends the job: succeeded (adapter zip + metrics CSV stored, `fine_tuned_model` set), cancelled
   (partial metrics kept), paused (the checkpoint of the step it stopped at registered), or failed
   (an `EngineError`'s code and message; anything unexpected gets a generic one-line message, and
   its traceback goes to the worker's log and to an operator-only event that tenants never see:
   `jobs.OPERATOR_EVENT`, `loraq jobs internal-errors`).
   A write that found the disk full goes back to the queue instead (`_out_of_disk`), and a worker
   whose disk has less than `min_free_disk_bytes` free claims nothing (`disk_space_wait`).

Every database write after the claim carries the claim's attempt token; once fenced out
(`StaleAttemptError`, or a heartbeat that no longer matches) this worker stops the run and
writes nothing more.

A job on several hosts (`n_nodes` > 1): the worker that claims it asks `n_nodes - 1` more to join
(`join_nodes`, task `loraq.join_job`); each runs `join_claimed_job`, the same steps with the same
claim and its own ranks. Whichever host got global rank 0 reports; a lost host ends the attempt
(`_node_failed`: back to the queue, to resume from the last checkpoint on the next set of workers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Literal

from sqlalchemy.exc import OperationalError

from service import files, jobs, storage
from service.db.session import session_scope
from service.errors import is_disk_full
from service.schemas import StoredCheckpointMetrics
from service.settings import Settings, get_settings
from service.step_metrics import event_data, metrics_csv
from worker import metrics as worker_metrics
from worker.engine.types import (
    CheckpointInfo,
    DatasetError,
    EngineError,
    NodeFailed,
    QuantizationName,
    Rendezvous,
    StepMetrics,
    StopRequested,
    TrainConfig,
    TrainResult,
)
from worker.launcher import advertised_host, worker_identity
from worker.metric_sinks import Sinks, open_sinks

log = logging.getLogger("loraq.worker")

WORKER_ID = worker_identity()  # "host:gpu2:pid": the job shows which host and GPU ran it
FLUSH_EVERY_SECONDS = 1.0
FLUSH_EVERY_STEPS = 50
CANCEL_CACHE_SECONDS = 1.0
GENERIC_FAILURE = "The job failed because of an internal error in the worker; the operator has the details."
MAX_MESSAGE_CHARS = 500

# Set when the Celery worker starts a warm shutdown (SIGTERM, `loraq up` stopping): the running
# job stops at its next step, keeps a checkpoint and goes back to the queue to resume elsewhere.
_worker_shutting_down = threading.Event()

# The last base model this process loaded, keyed by model name: the next job on the same model
# reuses it instead of reading the weights again. One entry: a GPU holds one base model at a time.
_model_cache: dict[str, Any] = {}


def on_worker_start() -> None:
    """Called once when the Celery worker is ready: say which kernel path this host will use."""
    import gpu_kernels

    status = gpu_kernels.available()
    log.info(
        "loraq worker %s ready; gpu kernels: compiled=%s (%s)", WORKER_ID, status.compiled, status.reason
    )
    # Import the engine now so the first job does not pay for importing torch/transformers.
    import worker.engine.recipe  # noqa: F401


def on_worker_shutting_down() -> None:
    """Called from Celery's `worker_shutting_down` signal (the signal handler's thread)."""
    _worker_shutting_down.set()


def cached_base_model(name: str, settings: Settings, quantization: QuantizationName | None = None) -> Any:
    """Load `name` once per process (stored as `quantization` asks: a quantized base is another
    entry); a different model replaces the cached one."""
    key = name if quantization is None else f"{name}:{quantization}"
    if key not in _model_cache:
        from worker.engine.models import load_base_model

        _model_cache.clear()  # free the previous model before loading the next
        _model_cache[key] = load_base_model(name, store=settings.model_store, quantization=quantization)
        log.info("loaded base model %s", key)
    return _model_cache[key]


class JobCallbacks:
    """`TrainingCallbacks` for one claimed attempt.

    Metrics are buffered and written every `FLUSH_EVERY_SECONDS` or `FLUSH_EVERY_STEPS` rows,
    whichever comes first, so a fast run does not pay one transaction per step. `should_stop()`
    reads the cancel flag at most once per `CANCEL_CACHE_SECONDS`, so a cancel is seen within one
    step once that step takes longer than the cache, and within a second otherwise.
    """

    def __init__(self, claim: jobs.Claim, *, checkpoint_dir_key: str) -> None:
        self.claim = claim
        self.checkpoint_dir_key = checkpoint_dir_key
        self.fenced = False
        self.stop: Literal["cancel", "pause"] | None = None  # what the job was asked to stop for
        self.saved_step = claim.resume_step  # of the last checkpoint registered (0: none)
        self.last_metrics: StepMetrics | None = None
        self._buffer: list[StepMetrics] = []
        self._last_flush = time.monotonic()
        self._cancel_checked_at = float("-inf")
        self.sinks = Sinks([], warn=self._warn)  # the job's integrations (`open_sinks`)

    def open_sinks(self, settings: Settings) -> None:
        """Start logging to the job's integrations, its configuration first."""
        claim = self.claim
        self.sinks = open_sinks(
            claim.integrations, job_id=claim.job_id, model=claim.model, settings=settings, warn=self._warn
        )
        config = {"job_id": claim.job_id, "model": claim.model, "n_gpus": claim.n_gpus}
        self.sinks.log_config({**config, **claim.training.model_dump(mode="json", exclude_none=True)})

    def close_sinks(self) -> None:
        """End the integrations' runs with the job's status as this attempt leaves it."""
        if not self.sinks:
            return
        try:
            with session_scope() as session:
                status = jobs.job_status(session, job_id=self.claim.job_id) or "running"
        except OperationalError:
            status = "running"  # unknown: MLflow's run stays open, W&B's is finished
        self.sinks.close(status)

    def _warn(self, message: str) -> None:
        self.on_event("warn", message)

    @property
    def cancel_requested(self) -> bool:
        return self.stop == "cancel"

    # -- TrainingCallbacks
    def on_step(self, metrics: StepMetrics) -> None:
        worker_metrics.observe_step(self.claim.job_id, metrics)  # Prometheus; never raises
        self.last_metrics = metrics
        self._buffer.append(metrics)
        due = time.monotonic() - self._last_flush >= FLUSH_EVERY_SECONDS
        if due or len(self._buffer) >= FLUSH_EVERY_STEPS:
            self.flush()

    def on_event(
        self, level: Literal["info", "warn", "error"], message: str, data: dict[str, Any] | None = None
    ) -> None:
        if self.fenced:
            return
        self.flush()  # a health warning names a step: that step's row is on the chart first
        with session_scope() as session:
            jobs.add_event(session, job_id=self.claim.job_id, level=level, message=message, data=data)
            if data is not None and "hyperparameters" in data:  # the run's plan (recipe.setup)
                jobs.record_plan(session, claim=self.claim, plan={**data, "message": message})
        if data is not None and "hyperparameters" in data:
            self.sinks.log_config({"plan": data["hyperparameters"]})

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        self.flush()
        if self.fenced:
            return
        if self._buffer:
            # Steps before this checkpoint are not stored (the database refused them: a full disk,
            # a lost connection). Registered, the checkpoint would be what a later attempt resumes
            # from, and those steps would never be run, so never stored, again. The run goes on;
            # the next checkpoint tries once more.
            log.warning(
                "job %s: checkpoint at step %d not registered: steps %d-%d are not stored yet",
                self.claim.job_id, checkpoint.step, self._buffer[0].step, self._buffer[-1].step,
            )  # fmt: skip
            return
        key = f"{self.checkpoint_dir_key}/step-{checkpoint.step:06d}.zip"
        # the zip, then its manifest, then the row: a worker killed midway leaves nothing that is read
        stored = storage.put_checkpoint(storage.default_store(), checkpoint.path, key, step=checkpoint.step)
        metrics = checkpoint_metrics(checkpoint, self.last_metrics)
        with session_scope() as session:
            jobs.register_checkpoint(
                session,
                claim=self.claim,
                step=checkpoint.step,
                storage_key=stored.key,
                sha256=stored.sha256,
                metrics=metrics,
            )
        self.saved_step = checkpoint.step

    def should_stop(self) -> bool:
        if self.fenced or self.stop is not None or _worker_shutting_down.is_set():
            return True
        now = time.monotonic()
        if now - self._cancel_checked_at >= CANCEL_CACHE_SECONDS:
            self._cancel_checked_at = now
            try:
                with session_scope() as session:
                    self.stop = jobs.stop_requested(session, job_id=self.claim.job_id)
            except OperationalError:  # a lost connection: asked again at the next check
                log.warning("job %s: cancel check failed", self.claim.job_id, exc_info=True)
        return self.stop is not None

    # -- helpers
    def flush(self) -> None:
        rows, self._buffer = self._buffer, []
        self._last_flush = time.monotonic()
        if not rows or self.fenced:
            return
        try:
            with session_scope() as session:
                stored = jobs.record_metrics(session, claim=self.claim, rows=rows)
            self.sinks.log_steps([event_data(m) for m in stored])  # each stored step, once
        except OperationalError:  # a lost connection (a frozen worker's, ended by the reaper)
            self._buffer = rows + self._buffer  # kept for the next flush; the heartbeat fences
            log.warning(
                "job %s: metrics not written, kept for the next flush", self.claim.job_id, exc_info=True
            )
        except jobs.StaleAttemptError:
            self.fenced = True
            log.warning(
                "job %s attempt %s fenced out while writing metrics", self.claim.job_id, self.claim.attempt
            )


class Heartbeat:
    """Background thread: `jobs.heartbeat` every `interval` s; a refused heartbeat fences the run."""

    def __init__(self, claim: jobs.Claim, callbacks: JobCallbacks, interval: float) -> None:
        self.claim = claim
        self.callbacks = callbacks
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{claim.job_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                with session_scope() as session:
                    alive = jobs.heartbeat(session, claim=self.claim)
            except Exception:  # a DB blip must not kill the thread; the next beat retries
                log.warning("heartbeat for job %s failed", self.claim.job_id, exc_info=True)
                continue
            if not alive:
                self.callbacks.fenced = True
                return


def checkpoint_metrics(checkpoint: CheckpointInfo, last: StepMetrics | None) -> StoredCheckpointMetrics:
    """The checkpoint's record: the losses of its step (the last one reported) and its samples."""
    losses = last if last is not None and last.step == checkpoint.step else None
    return StoredCheckpointMetrics(
        step=checkpoint.step,
        train_loss=losses.train_loss if losses else None,
        valid_loss=losses.valid_loss if losses else None,
        full_valid_loss=losses.valid_loss if losses else None,
        samples=checkpoint.samples,
    )


def attempt_dir(settings: Settings, claim: jobs.Claim) -> Path:
    return settings.resolved_data_dir / "jobs" / claim.job_id / f"attempt-{claim.attempt}"


def build_train_config(claim: jobs.Claim, settings: Settings, out_dir: Path) -> TrainConfig:
    """The engine's config for the claim's training configuration ("auto" is planned by the engine
    from the data), with its files from the store, its output under `out_dir` and this
    deployment's checkpoints and limits."""
    training = claim.training
    if training.checkpoint_every is None:  # the job left it to the service
        training = training.model_copy(update={"checkpoint_every": settings.checkpoint_every})
    store = storage.default_store()
    resume: Path | None = None
    if claim.resume_checkpoint:
        resume = out_dir / "resume"
        sha256 = storage.checkpoint_sha256(store, claim.resume_checkpoint)  # trusted_resume found it
        store.extract_zip(claim.resume_checkpoint, resume, sha256)
    return TrainConfig.build(
        training,
        model=claim.model,
        train_file=store.materialize(claim.training_file),
        validation_file=store.materialize(claim.validation_file) if claim.validation_file else None,
        output_dir=out_dir,
        model_store=settings.model_store,
        checkpoint_each_epoch=settings.checkpoint_each_epoch,
        checkpoint_interval_seconds=settings.checkpoint_interval_seconds,
        resume_from=resume,
        max_wall_seconds=settings.job_max_wall_seconds,
        max_tokens=settings.job_max_tokens,
        step_limit=settings.job_max_steps,
    )


def trusted_resume(claim: jobs.Claim) -> jobs.Claim:
    """The claim, resuming from the latest registered checkpoint whose manifest is in the store
    (`storage.put_checkpoint`); one without (lost, or registered before manifests were written)
    is skipped for the one before it, and none left starts from step 0."""
    store = storage.default_store()
    if claim.resume_checkpoint is None or storage.checkpoint_sha256(store, claim.resume_checkpoint):
        return claim
    with session_scope() as session:
        rows = [(c.storage_key, c.step) for c in jobs.checkpoints_by_step(session, job_id=claim.job_id)]
    for key, step in reversed(rows):
        if step < claim.resume_step and storage.checkpoint_sha256(store, key):
            log.warning("job %s: checkpoint %s has no manifest; resuming from step %d", claim.job_id,
                        claim.resume_checkpoint, step)  # fmt: skip
            return dataclasses.replace(claim, resume_checkpoint=key, resume_step=step)
    log.warning("job %s: no checkpoint has a manifest; starting from step 0", claim.job_id)
    return dataclasses.replace(claim, resume_checkpoint=None, resume_step=0)


def fine_tuned_model_name(claim: jobs.Claim) -> str:
    return f"ft:{claim.model}:{claim.suffix or ''}:{claim.job_id}"


def ensure_base_model(name: str, settings: Settings, callbacks: JobCallbacks) -> None:
    """A catalog model's first use downloads it here, its milestones as job events (the heartbeat
    keeps going meanwhile). With `LORAQ_AUTO_PULL=0` the submit refused such a job already."""
    if not settings.auto_pull:
        return
    from worker.engine.pull import ensure_pulled

    ensure_pulled(
        name,
        settings.model_store,
        lambda message: callbacks.on_event("info", message),
        should_stop=callbacks.should_stop,  # a cancel is honoured while the base model downloads
    )


def run_engine(
    config: TrainConfig, callbacks: JobCallbacks, settings: Settings, rendezvous: Rendezvous | None = None
) -> TrainResult | None:
    """Train; None when this worker is one host of a job on several and another host's worker
    reports the result (it held global rank 0)."""
    from worker.engine import recipe

    # training series + the registry's current job; ended by worker.tasks (outcome)
    worker_metrics.job_started(callbacks.claim.job_id, model=config.model, max_grad_norm=config.max_grad_norm)
    n, workdir = callbacks.claim.n_gpus, config.output_dir / "torchrun"
    if rendezvous is not None:  # this host's ranks of a job on several hosts
        from worker.engine.distributed import run_node

        return run_node(config, callbacks, n_gpus=n, workdir=workdir, rendezvous=rendezvous)
    if n > 1:
        # one rank per GPU under torchrun (each rank loads the model); rank 0's reports
        # come back here as calls on `callbacks`.
        from worker.engine.distributed import run_torchrun

        return run_torchrun(config, callbacks, n_gpus=n, workdir=workdir)
    loaded = cached_base_model(config.model, settings, config.quantization)
    return recipe.train(config, callbacks, loaded=loaded)


def disk_space_wait(settings: Settings) -> str | None:
    """What a job waits for while this worker's data dir has less than `min_free_disk_bytes` free
    (it would run out of space at its first checkpoint), or None."""
    floor, data_dir = settings.min_free_disk_bytes, settings.resolved_data_dir
    existing = next(p for p in (data_dir, *data_dir.parents) if p.exists())  # made at first write
    if floor <= 0 or (free := shutil.disk_usage(existing).free) >= floor:
        return None
    log.warning("data dir %s has %d bytes free, less than %d: no job claimed", data_dir, free, floor)
    return (
        f"disk space on worker {WORKER_ID}: its data directory has less than {floor / 2**20:g} MiB free; "
        "the job starts once space is freed"
    )


def run_claimed_job(job_id: str, *, worker_id: str = WORKER_ID) -> str:
    """Run one job if this delivery can claim it. Returns the outcome, for the task's log line."""
    settings = get_settings()
    if (wait := disk_space_wait(settings)) is not None:
        try:  # the job stays queued; the reconciler sends it again (service/reaper.py)
            with session_scope() as session:
                jobs.mark_waiting(session, job_id=job_id, reason=wait)
        except OperationalError:  # a database on the same full disk: it says so in the log
            log.warning("job %s: could not record what it waits for", job_id, exc_info=True)
        return "skipped"
    with session_scope() as session:
        claim = jobs.claim_next(session, job_id=job_id, worker_id=worker_id)
    if claim is None:
        log.info("job %s: nothing claimable for this delivery (taken, cancelled, done or waiting)", job_id)
        return "skipped"
    if claim.job_id != job_id:  # fair share: the delivery of one job's message claimed another
        log.info("delivery of job %s claimed job %s (fair share)", job_id, claim.job_id)
    return run_attempt(trusted_resume(claim), settings, first_node=True)


def join_claimed_job(job_id: str, *, attempt: int, endpoint: str, worker_id: str = WORKER_ID) -> str:
    """Run this worker's share of attempt `attempt` of a job on several hosts, whose first worker
    serves the rendezvous at `endpoint`: the same claim (its token), its own ranks."""
    settings = get_settings()
    with session_scope() as session:
        claim = jobs.join(session, job_id=job_id, attempt=attempt, worker_id=worker_id)
    if claim is None:
        log.info("job %s attempt %d: ended or cancelled before this worker joined", job_id, attempt)
        return "skipped"
    return run_attempt(trusted_resume(claim), settings, first_node=False, endpoint=endpoint)


def node_rendezvous(claim: jobs.Claim, settings: Settings, endpoint: str | None) -> Rendezvous:
    """This host's part of the attempt's rendezvous; `endpoint` None: this worker claimed the job
    and serves the rendezvous's store, on a free port of its address."""
    address = settings.worker_rendezvous_address or advertised_host()
    is_host = endpoint is None
    if endpoint is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
            endpoint = f"{address}:{probe.getsockname()[1]}"
    return Rendezvous(
        endpoint=endpoint,
        run_id=f"{claim.job_id}-{claim.attempt}",
        n_nodes=claim.n_nodes,
        local_addr=address,
        is_host=is_host,
        join_timeout_s=settings.node_join_timeout_seconds,
    )


def run_attempt(
    claim: jobs.Claim, settings: Settings, *, first_node: bool, endpoint: str | None = None
) -> str:
    """Run one claimed attempt to its end (on this host: one of the hosts of a job on several)."""
    job_id = claim.job_id
    out_dir = attempt_dir(settings, claim)
    # Store keys carry the attempt: a fenced-out attempt that keeps running for a moment (a
    # frozen worker woken up) writes only its own objects and never replaces the current one's.
    callbacks = JobCallbacks(claim, checkpoint_dir_key=f"jobs/{job_id}/attempt-{claim.attempt}/checkpoints")
    try:
        rendezvous = node_rendezvous(claim, settings, endpoint) if claim.n_nodes > 1 else None
        with Heartbeat(claim, callbacks, settings.heartbeat_seconds):
            if first_node:
                callbacks.on_event("info", f"Fine-tuning job started (attempt {claim.attempt})")
                callbacks.on_event("info", resume_message(claim))
                callbacks.open_sinks(settings)  # none for n_nodes > 1 (jobs.check_nodes)
            config = build_train_config(claim, settings, out_dir)
            ensure_base_model(config.model, settings, callbacks)
            if rendezvous is not None:
                join_nodes(claim, rendezvous, callbacks, first_node=first_node)
            result = run_engine(config, callbacks, settings, rendezvous)
            callbacks.flush()
        if callbacks.fenced:
            return "fenced"
        if result is None:
            return "node_done"  # global rank 0 was on another host, whose worker ends the job
        if result.stopped:
            trained = result.trained_tokens if result.steps else None
            return _stopped(claim, callbacks, trained_tokens=trained, step=result.steps)
        return _succeed(claim, result)
    except StopRequested:  # stopped while the base model downloaded: nothing trained in this attempt
        callbacks.flush()
        if callbacks.fenced:
            return "fenced"
        return _stopped(claim, callbacks, trained_tokens=None, step=claim.resume_step)
    except NodeFailed as e:
        callbacks.flush()
        log.warning("job %s: %s; torchrun's log here:\n%s", job_id, e, e.log_tail)
        if callbacks.stop is not None:  # asked to stop while the hosts gathered (or as one was lost)
            return _stopped(claim, callbacks, trained_tokens=None, step=callbacks.saved_step)
        return _node_failed(claim, str(e), settings)
    except DatasetError as e:
        callbacks.flush()
        return _fail(claim, code=e.code, message=str(e), param=e.param or "training_file")
    except EngineError as e:
        callbacks.flush()
        return _fail(claim, code=e.code, message=str(e), param=e.param)
    except jobs.StaleAttemptError:
        return "fenced"
    except Exception as e:
        if is_disk_full(e):
            callbacks.flush()
            return _out_of_disk(claim, callbacks.saved_step, settings)
        log.exception("job %s crashed", job_id)
        callbacks.flush()
        with session_scope() as session:
            jobs.add_event(
                session,
                job_id=job_id,
                level="error",
                message=f"worker exception on {WORKER_ID}",
                data={"traceback": traceback.format_exc(limit=20)},
                type=jobs.OPERATOR_EVENT,
            )
        return _fail(claim, code="internal_error", message=GENERIC_FAILURE, param=None)
    finally:
        callbacks.close_sinks()
        # in the background: the task's outcome (and its metrics) must not wait on the broker
        threading.Thread(target=_wake_waiting, args=(claim,), name="loraq-wake", daemon=True).start()
        # The adapter and checkpoints are in the store now; the attempt's scratch space can go.
        shutil.rmtree(out_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the job's directory, once no attempt is left in it
            out_dir.parent.rmdir()


def _wake_waiting(claim: jobs.Claim) -> None:
    """This attempt freed a running-job slot of its tenant: send a wake-up for the tenant's oldest
    job waiting for one, so it starts now rather than at the reconciler's next re-send."""
    from service.queue import enqueue_job

    try:
        with session_scope() as session:
            waiting = jobs.oldest_waiting(session, tenant_id=claim.tenant_id)
        if waiting is not None:
            enqueue_job(waiting)
    except Exception:  # best effort: the reconciler re-sends queued jobs anyway
        log.warning("could not wake the waiting jobs of %s", claim.tenant_id, exc_info=True)


def _succeed(claim: jobs.Claim, result: TrainResult) -> str:
    adapter = storage.default_store().put_dir_zip(
        result.adapter_dir, f"jobs/{claim.job_id}/attempt-{claim.attempt}/adapter.zip"
    )
    with session_scope() as session:
        rows = jobs.metric_rows(session, job_id=claim.job_id)
        results_file = files.create_file_from_bytes(
            session,
            tenant_id=claim.tenant_id,
            filename=f"{claim.job_id}-results.csv",
            purpose="fine-tune-results",
            content=metrics_csv(rows),
        )
        ok = jobs.finish(
            session,
            claim=claim,
            status="succeeded",
            trained_tokens=result.trained_tokens,
            adapter_key=adapter.key,
            adapter_sha256=adapter.sha256,
            result_file_id=results_file.id,
            fine_tuned_model=fine_tuned_model_name(claim),
        )
        if ok:
            jobs.add_event(
                session, job_id=claim.job_id, level="info", message="The job has successfully completed"
            )
        else:
            session.rollback()  # fenced out: its results file row must not become visible
    return "succeeded" if ok else "fenced"


def _stopped(claim: jobs.Claim, callbacks: JobCallbacks, *, trained_tokens: int | None, step: int) -> str:
    """End a run that stopped on request: paused (its checkpoint saved, the GPU freed), back to
    the queue (the worker shuts down), or cancelled."""
    if callbacks.stop == "pause":
        return _paused(claim, trained_tokens=trained_tokens, step=step)
    if callbacks.stop is None and _worker_shutting_down.is_set():
        return _requeue(claim, reason="the worker shut down; the job resumes from its last checkpoint")
    return _cancelled(claim, trained_tokens=trained_tokens)


def _paused(claim: jobs.Claim, *, trained_tokens: int | None, step: int) -> str:
    """running → paused; a pause withdrawn while the run stopped sends the job back to the queue
    instead (it resumes from the checkpoint just saved), a cancel that came meanwhile ends it."""
    with session_scope() as session:
        if jobs.pause(session, claim=claim, step=step):
            return "paused"
        stop = jobs.stop_requested(session, job_id=claim.job_id)
    if stop == "cancel":
        return _cancelled(claim, trained_tokens=trained_tokens)
    return _requeue(claim, reason="its pause was withdrawn as it stopped; it resumes from its checkpoint")


def _cancelled(claim: jobs.Claim, *, trained_tokens: int | None) -> str:
    """End a run that stopped on a cancel request; its metrics and checkpoints stay (one stopped
    before its first step, while its base model downloaded or its data was prepared, passes None:
    the job keeps the tokens an earlier attempt trained)."""
    with session_scope() as session:
        ok = jobs.finish(session, claim=claim, status="cancelled", trained_tokens=trained_tokens)
        if ok:
            jobs.add_event(session, job_id=claim.job_id, level="info", message="Fine-tuning job cancelled")
    return "cancelled" if ok else "fenced"


def resume_message(claim: jobs.Claim) -> str:
    """The event that says where this attempt starts: the step of the checkpoint it resumes from,
    or step 0 (a first attempt, or a later one whose earlier attempts saved no checkpoint)."""
    if claim.resume_checkpoint is not None:
        return f"Resuming from the checkpoint at step {claim.resume_step}"
    if claim.attempt > 1:
        return "Restarting from step 0: no checkpoint was saved by the earlier attempt"
    return "Starting from step 0"


def one_line(message: str) -> str:
    """What a tenant reads in a job's `error` and events: one line, bounded."""
    text = "; ".join(part.strip() for part in message.splitlines() if part.strip())
    return text if len(text) <= MAX_MESSAGE_CHARS else text[: MAX_MESSAGE_CHARS - 1] + "…"


def _fail(claim: jobs.Claim, *, code: str, message: str, param: str | None) -> str:
    message = one_line(message)
    error = {"code": code, "message": message, "param": param}
    with session_scope() as session:
        ok = jobs.finish(session, claim=claim, status="failed", error=error)
        if ok:
            jobs.add_event(session, job_id=claim.job_id, level="error", message=message)
    return "failed" if ok else "fenced"


def join_nodes(
    claim: jobs.Claim, rendezvous: Rendezvous, callbacks: JobCallbacks, *, first_node: bool
) -> None:
    """The first worker asks `n_nodes - 1` more of its queue to join at its rendezvous; each one
    that does says so. The first one's torchrun then waits for them (`node_join_timeout_seconds`)."""
    from service.queue import enqueue_join

    n = claim.n_nodes
    if not first_node:
        callbacks.on_event("info", f"Worker {WORKER_ID} joined the job's {n} hosts")
        return
    try:
        enqueue_join(claim.job_id, attempt=claim.attempt, endpoint=rendezvous.endpoint, count=n - 1)
    except Exception as e:
        raise NodeFailed(
            f"could not ask {n - 1} more worker(s) to join: the broker did not take it ({e})"
        ) from e
    callbacks.on_event(
        "info",
        f"Waiting for {n - 1} more worker(s) of the queue to join (rendezvous at {rendezvous.endpoint})",
    )


def _node_failed(claim: jobs.Claim, what: str, settings: Settings) -> str:
    """A job on several hosts lost one of them (or not every host joined): this attempt ends, and
    while attempts are left the job goes back to the queue, to resume from its last checkpoint on
    the workers that take it next; on its last attempt it fails with code `node_failed`. Every
    host that saw the loss gets here; the attempt's token lets only the first end it."""
    attempt = claim.attempt - claim.paused_attempts  # attempts ended by a pause are not retries
    what = f"{what} (attempt {attempt} of {settings.max_attempts})"
    if attempt < settings.max_attempts:
        return _requeue(claim, reason=f"{what}; it resumes from its last checkpoint")
    return _fail(claim, code=NodeFailed.code, message=what, param="n_nodes")


def _out_of_disk(claim: jobs.Claim, saved_step: int, settings: Settings) -> str:
    """A write found the disk full: a checkpoint, the adapter's export, an object in the store.
    Every registered checkpoint is whole (stored first, then registered), so the job keeps the
    last one. While attempts are left the job goes back to the queue, waits there until a worker
    has disk space (`disk_space_wait`) and resumes from that checkpoint; on its last attempt it
    fails with code `disk_full`."""
    kept = f"its checkpoint at step {saved_step} is kept" if saved_step else "it had saved no checkpoint"
    attempt = claim.attempt - claim.paused_attempts  # attempts ended by a pause are not retries
    what = f"the worker ran out of disk space (attempt {attempt} of {settings.max_attempts}); {kept}"
    log.warning("job %s: %s", claim.job_id, what, exc_info=True)
    if attempt < settings.max_attempts:
        return _requeue(claim, reason=f"{what}; it resumes from step {saved_step} once a worker has space")
    message = f"{what}; free disk space, then submit the job again"
    return _fail(claim, code="disk_full", message=message, param=None)


def _requeue(claim: jobs.Claim, *, reason: str) -> str:
    """running → queued for this attempt, then a new wake-up message: the next worker to take it
    claims a new attempt and resumes from the last registered checkpoint."""
    from service.queue import enqueue_job

    with session_scope() as session:
        ok = jobs.requeue(session, job_id=claim.job_id, attempt_token=claim.attempt_token, reason=reason)
    if not ok:
        return "fenced"
    enqueue_job(claim.job_id)
    return "requeued"
