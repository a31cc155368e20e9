"""`loraq inference`: the worker that serves chat completions (protocol: service/inference.py).

One process, one loop: pop requests (BLPOP, then whatever else is waiting), admit each into the
running batch of its base model, run one decode step of every batch, and repeat, so requests that
arrive mid-decode join at the next step (continuous batching, up to `inference_max_batch` rows
per base). Every row carries its adapter's slot (worker.engine.serving). Base models stay loaded
(an LRU of `inference_max_models`), adapters are loaded from the store on first use and kept in
an LRU of `inference_max_adapters` slots per base model.

From its first moment until it serves, the worker is marked as starting (`StartingBeat`): a chat
request that comes meanwhile waits for it (service/inference.py). A request whose base model is not
loaded yet is told so at once (a "loading" event: the API streams a comment and a `notice`), and
its "start" event says how long loading took.

A job's dry run (tokenizing its files as the job would) runs on a thread of its own, one at a
time, beside the decode loop: a large file takes minutes to tokenize, and chat streams must not
stop meanwhile. While it works it sends a "progress" event every quarter of
`inference_timeout_seconds`, so that the API, which gives up after that long without an event,
keeps waiting.

Prometheus (own registry, port `inference_metrics_port`): time to first token, generated tokens/s
per request, requests by outcome, and `loraq_redis_up`.

A Redis outage (stalled, restarting, reloading its append-only file) is ridden out: the loop
retries with backoff (service/dependency.py) and serves again once Redis answers, re-registering
first. Requests being decoded when Redis went away are dropped (outcome `dropped`): their replies
could not be delivered, and their callers have been told `inference_timeout`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from service.dependency import DependencyHealth
from service.inference import (
    REPLY_TTL_SECONDS,
    mark_starting,
    reply_key,
    requests_key,
    starting_key,
    workers_key,
)
from service.redis_client import REDIS_OUTAGE, redis_client
from service.settings import Settings
from worker.engine.tool_calls import parse_tool_calls
from worker.engine.types import EngineError

if TYPE_CHECKING:
    from worker.engine.data import Examples
    from worker.engine.serving import Adapter, DecodeBatch, GenRequest, GenResult, ServingModel, TokenLogprob

log = logging.getLogger("loraq.inference")

HEARTBEAT_SECONDS = 2.0
POP_TIMEOUT_SECONDS = 1.0
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPS_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "loraq_inference_time_to_first_token_seconds",
            "From the API's push of a request to its first generated token",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tokens_per_s = Histogram(
            "loraq_inference_tokens_per_second",
            "Generated tokens per second of one request, first token to last",
            ["model"],
            buckets=TPS_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "loraq_inference_generated_tokens", "Tokens generated", ["model"], registry=self.registry
        )
        self.requests = Counter(
            "loraq_inference_requests", "Requests by outcome", ["outcome"], registry=self.registry
        )
        self.redis_up = Gauge(
            "loraq_redis_up", "1 while this process's last Redis call succeeded", registry=self.registry
        )


@contextlib.contextmanager
def repeating(period: float, call: Callable[[], None] | None) -> Iterator[None]:
    """Run `call()` every `period` seconds from a daemon thread while the block runs (None:
    nothing). A call that raises is logged and the next one still comes: it must not fail the
    work it accompanies."""
    if call is None:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period):
            try:
                call()
            except Exception:
                log.warning("a repeating call failed", exc_info=True)

    thread = threading.Thread(target=run, name="inference-repeating", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class ModelsBusy(RuntimeError):
    """Loading another base model would unload one that is decoding; the request waits."""


@dataclass(eq=False)  # compared by identity: a Pending is the key of its row in a DecodeBatch
class Pending:
    """One request of a batch: the protocol fields and its decoding state."""

    raw: dict[str, Any]
    pushed_at: float
    gen: GenRequest | None = None
    first_token_at: float | None = None
    pieces: list[str] = field(default_factory=list)
    loading_since: float | None = None  # told "loading": when its base model began to load
    load_seconds: float | None = None  # how long that took
    logprobs_sent: int = 0  # a stream with logprobs: how many tokens' logprobs its deltas carried


class InferenceWorker:
    def __init__(self, settings: Settings, worker_id: str | None = None) -> None:
        self.settings = settings
        self.queue = settings.inference_queue
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        # BLPOP waits up to POP_TIMEOUT_SECONDS: the socket waits that long plus the usual bound
        self.redis = redis_client(
            settings, socket_timeout=POP_TIMEOUT_SECONDS + settings.redis_socket_timeout_seconds
        )
        self.models: OrderedDict[str, ServingModel] = OrderedDict()
        self.batches: dict[str, DecodeBatch] = {}  # base model -> rows decoding on it
        self.waiting: list[Pending] = []  # chat requests not admitted yet
        self._tokenizers: dict[str, Any] = {}  # read and written by the dry-run thread only
        # dry runs, one at a time, off the decode loop (tokenizing a large file takes minutes)
        self._dry_runs = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference-dry-run")
        self.metrics = Metrics()
        self.redis_health = DependencyHealth("Redis", log)
        self.registered = False  # in the workers zset since the last outage
        self._stop = threading.Event()

    # -- lifecycle
    def start(self) -> None:
        import torch

        from worker.kernels import configure_kernels

        configure_kernels(self.settings)
        if not torch.cuda.is_available():
            torch.set_num_threads(self.settings.inference_cpu_threads)
        port = self.settings.inference_metrics_port
        try:
            server, _ = start_http_server(port, addr=self.settings.host, registry=self.metrics.registry)
            log.info("inference metrics on %s:%d", self.settings.host, server.server_port)
        except OSError:  # as the Celery worker's: a taken port loses the metrics, not the service
            log.exception("inference metrics could not start on port %d; serving without /metrics", port)
        for name in self.settings.inference_preload:
            self.model(name)
        # Registered before "ready" (the API refuses requests while no worker is) if Redis answers;
        # if not, the serving loop registers once it does.
        with contextlib.suppress(*REDIS_OUTAGE):
            self._register()
        threading.Thread(target=self._heartbeat, name="inference-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        self._dry_runs.shutdown(wait=False, cancel_futures=True)

    def _register(self) -> None:
        """Join the workers zset: the API refuses chat requests while no worker is in it."""
        self.redis.zadd(workers_key(self.queue), {self.worker_id: time.time()})
        if not self.registered:
            self.registered = True
            log.info("inference worker %s ready on queue %s", self.worker_id, self.queue)

    def _heartbeat(self) -> None:
        while not self._stop.is_set():
            if self.registered:
                # a failure is the serving loop's to report and retry; this thread only keeps trying
                with contextlib.suppress(*REDIS_OUTAGE):
                    self._register()
            self._stop.wait(HEARTBEAT_SECONDS)

    def serve_forever(self) -> None:
        self.start()
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register()
                    self._redis_answers()
                self.serve_once(POP_TIMEOUT_SECONDS)
            except REDIS_OUTAGE as exc:
                self._redis_lost(exc)
                continue
            self._redis_answers()
        with contextlib.suppress(*REDIS_OUTAGE):
            self.redis.zrem(workers_key(self.queue), self.worker_id)

    def _redis_answers(self) -> None:
        self.redis_health.ok()
        self.metrics.redis_up.set(1)

    def _redis_lost(self, exc: BaseException) -> None:
        """Drop what is in flight (its replies cannot be delivered), then wait out the backoff."""
        self.metrics.redis_up.set(0)
        self.registered = False
        dropped = self.waiting + [row.key for batch in self.batches.values() for row in batch.rows]
        self.waiting = []
        for batch in self.batches.values():
            batch.keep([])
        if dropped:
            log.warning("dropped %d request(s) in flight: Redis went away", len(dropped))
            self.metrics.requests.labels("dropped").inc(len(dropped))
        self._stop.wait(self.redis_health.failed(exc))

    def serve_once(self, timeout: float) -> int:
        """Wait up to `timeout` for requests, then decode until every batch has drained, admitting
        requests that arrive meanwhile into the running batches (continuous batching). Returns
        how many requests were popped."""
        popped = self._take(self._pop(timeout))
        while self.waiting or any(batch.rows for batch in self.batches.values()):
            popped += self._take(self._pop(None))
            self._admit_waiting()
            for base, batch in list(self.batches.items()):
                if batch.rows:
                    self._step(base, batch)
        return popped

    def _pop(self, timeout: float | None) -> list[bytes]:
        """Up to `inference_max_batch` raw requests: block up to `timeout` for the first, or with
        None take only what is waiting."""
        key = requests_key(self.queue)
        if timeout is None:
            waiting: Any = self.redis.lpop(key, self.settings.inference_max_batch)  # a list, or None
            return list(waiting or [])
        item = self.redis.blpop([key], timeout=timeout)
        if item is None:
            return []
        return [item[1], *(self.redis.lpop(key, self.settings.inference_max_batch - 1) or [])]

    def _take(self, raws: list[bytes]) -> int:
        """Dry runs go to their thread; chat requests wait for admission (expired ones are
        dropped)."""
        now = time.time()
        for raw in raws:
            request = json.loads(raw)
            p = Pending(raw=request, pushed_at=float(request["sent_at"]))
            if float(request["deadline"]) < now:  # the API has given up on it
                self.metrics.requests.labels("expired").inc()
            elif request.get("kind") == "dry_run":
                self._dry_runs.submit(self._dry_run, p)
            else:
                self.waiting.append(p)
        return len(raws)

    def _keeping_alive(self, call: Callable[[], None] | None) -> contextlib.AbstractContextManager[None]:
        """`call()` every quarter of `inference_timeout_seconds` while the block runs: the API
        gives up on a request after that long without an event, and a base model's load or a
        dry run's tokenizing can take longer."""
        return repeating(self.settings.inference_timeout_seconds / 4, call)

    # -- models and adapters
    def model(self, name: str, on_load: Callable[[str], None] | None = None) -> ServingModel:
        """The loaded base model `name`, loading it first if need be (`on_load(name)` is called
        right before a load starts, and again from another thread every quarter of
        `inference_timeout_seconds` while it lasts: the requests waiting for it are told)."""
        if name in self.models:
            self.models.move_to_end(name)
            return self.models[name]
        from worker.engine.serving import load_serving_model

        while len(self.models) >= self.settings.inference_max_models:
            idle = [n for n in self.models if not (n in self.batches and self.batches[n].rows)]
            if not idle:
                raise ModelsBusy(name)
            del self.models[idle[0]]  # the least recently used of the idle ones
            log.info("unloaded base model %s", idle[0])
        if on_load is not None:
            on_load(name)
        started = time.monotonic()
        again = partial(on_load, name) if on_load is not None else None
        with self._keeping_alive(again):
            self.models[name] = load_serving_model(
                name, store=self.settings.model_store, max_adapters=self.settings.inference_max_adapters
            )
        log.info("loaded base model %s in %.1fs", name, time.monotonic() - started)
        return self.models[name]

    def read_adapter(self, key: str, sha256: str) -> Adapter:
        from service.storage import default_store
        from worker.engine.serving import Adapter

        return Adapter.from_zip(default_store().materialize(key, sha256))

    def tokenizer(self, name: str) -> Any:
        """A loaded model's tokenizer, else the tokenizer alone (cached; no weights loaded).
        Called from the dry-run thread: one lookup of `models`, which the decode loop changes."""
        loaded = self.models.get(name)
        if loaded is not None:
            return loaded.tokenizer
        if name not in self._tokenizers:
            from worker.engine.models import load_tokenizer

            self._tokenizers[name] = load_tokenizer(name, store=self.settings.model_store)
        return self._tokenizers[name]

    # -- a job's dry run: tokenize its files as the job would (service/dry_run.py plans the rest)
    def _dry_run(self, p: Pending) -> None:
        """On the dry-run thread: "done" with the files' reports and the plan, or "error"; a
        "progress" event every quarter of the API's timeout until then. A reply that Redis
        cannot take is dropped (the API has told its caller `inference_timeout`)."""
        progress = {"type": "progress", "stage": "reading and tokenizing the files"}
        outcome: dict[str, Any] | Exception
        with self._keeping_alive(partial(self._push, p, progress)):
            try:
                outcome = self._dry_run_done(p)
            except Exception as exc:
                outcome = exc
        try:  # after the last "progress": the reply ends with "done" or "error"
            if isinstance(outcome, Exception):
                self._fail(p, outcome)
                return
            self.metrics.requests.labels("dry_run").inc()
            self._push(p, outcome)
        except REDIS_OUTAGE:
            log.warning("dropped dry run %s: Redis went away", p.raw.get("id"))
            self.metrics.requests.labels("dropped").inc()

    def _dry_run_done(self, p: Pending) -> dict[str, Any]:
        """The dry run's "done" event: each file's report and what the job trains on."""
        from service.storage import default_store
        from worker.engine.data import read_examples

        store = default_store()
        tokenizer = self.tokenizer(p.raw["base"])
        max_seq_len = int(p.raw["max_seq_len"])
        reports: dict[str, Any] = {"training_file": None, "validation_file": None}
        examples: dict[str, Any] = {}
        for name in reports:
            key = p.raw.get(name)  # a store key, or None (no validation file)
            if key:
                examples[name], report = read_examples(store.materialize(key), tokenizer, max_seq_len)
                reports[name] = asdict(report)
        training = _trained_part(examples["training_file"], reports["training_file"], tokenizer, p.raw)
        return {"type": "done", **reports, "training": training}

    # -- chat requests: admission into a base model's batch, then one decode step at a time
    def _admit_waiting(self) -> None:
        """Admit what is waiting, base model by base model: a model's requests join its batch in
        one `admit` call (one prefill for all of them, so requests arriving together get their
        first tokens together), up to `inference_max_batch` rows. The rest keep their order."""
        from worker.engine.serving import DecodeBatch

        groups: dict[str, list[Pending]] = {}
        for p in self.waiting:
            groups.setdefault(p.raw["base"], []).append(p)
        still: set[int] = set()  # id() of the requests that wait on
        for base, group in groups.items():
            batch = self.batches.setdefault(base, DecodeBatch())
            try:
                model = self.model(base, on_load=partial(self._announce_loading, group))
            except ModelsBusy:
                still.update(id(p) for p in group)  # every loaded model is decoding: wait for one to drain
                continue
            except Exception as exc:
                for p in group:
                    self._fail(p, exc)
                continue
            for p in group:
                if p.loading_since is not None and p.load_seconds is None:
                    p.load_seconds = round(time.monotonic() - p.loading_since, 1)
            joining: list[tuple[Pending, GenRequest]] = []
            for p in group:
                if (batch.rows and not model.joins) or len(batch.rows) + len(
                    joining
                ) >= self.settings.inference_max_batch:
                    still.add(id(p))
                    continue
                try:
                    gen = self._prepare(model, batch, p, {g.slot for _, g in joining})
                except Exception as exc:
                    self._fail(p, exc)
                    continue
                if gen is None:  # every adapter slot is used by rows still decoding or joining
                    still.add(id(p))
                    continue
                joining.append((p, gen))
            if not joining:
                continue
            try:
                model.admit(batch, list(joining))
            except Exception as exc:
                for p, _ in joining:
                    self._fail(p, exc)
                continue
            for p, gen in joining:
                start = {"prompt_tokens": len(gen.prompt_ids), "load_seconds": p.load_seconds}
                self._push(p, {"type": "start", **start})
        self.waiting = [p for p in self.waiting if id(p) in still]

    def _announce_loading(self, group: list[Pending], name: str) -> None:
        """Tell the requests waiting for base model `name` that it is loading (tens of seconds on
        a CPU): before the load starts, and again while it lasts, since the API gives up on a
        request after `inference_timeout_seconds` without an event and a large base can take
        longer than that to load."""
        now = time.monotonic()
        told_first = [p for p in group if p.loading_since is None]
        if told_first:
            log.info("loading base model %s for %d chat request(s)", name, len(told_first))
        for p in told_first:
            p.loading_since = now
        for p in group:
            self._push(p, {"type": "loading", "model": name})

    def _prepare(self, model: ServingModel, batch: Any, p: Pending, joining: set[int]) -> GenRequest | None:
        """The request's decoding parameters, its adapter loaded into a slot; None when no slot is
        free of the rows decoding now and of `joining`, the slots of the requests being admitted."""
        from worker.engine.serving import GenRequest

        slot = 0
        key = p.raw.get("adapter_key")
        if key:
            in_use = (set(batch.slots.tolist()) if batch.rows else set()) | joining
            if key not in model.loaded_adapters and len(in_use - {0}) >= self.settings.inference_max_adapters:
                return None
            sha256 = str(p.raw["adapter_sha256"])
            slot = model.adapter_slot(key, partial(self.read_adapter, key, sha256), keep=in_use)
        ids = model.prompt_ids(p.raw["messages"], p.raw.get("tools"))
        max_tokens = p.raw.get("max_tokens") or max(1, model.max_context - len(ids))
        model.check_fits(len(ids), max_tokens)
        p.gen = GenRequest(
            prompt_ids=ids,
            max_tokens=max_tokens,
            slot=slot,
            temperature=float(p.raw.get("temperature", 1.0)),
            top_p=float(p.raw.get("top_p", 1.0)),
            seed=None if p.raw.get("seed") is None else int(p.raw["seed"]) % 2**63,
            stop=list(p.raw.get("stop") or []),
            top_logprobs=p.raw.get("top_logprobs"),
        )
        return p.gen

    def _step(self, base: str, batch: Any) -> None:
        model = self.models[base]
        rows = {row.key: row for row in batch.rows}

        def on_text(p: Pending, delta: str) -> None:
            if p.first_token_at is None:
                p.first_token_at = time.time()
                self.metrics.ttft.labels(base).observe(p.first_token_at - p.pushed_at)
            if delta and p.raw.get("stream") and not p.raw.get("tools"):  # tools: answered whole
                event: dict[str, Any] = {"type": "delta", "text": delta}
                if p.raw.get("top_logprobs") is not None:  # the tokens whose text this delta ends
                    logprobs = rows[p].logprobs
                    event["logprobs"] = [_logprob_json(model, t) for t in logprobs[p.logprobs_sent :]]
                    p.logprobs_sent = len(logprobs)
                self._push(p, event)

        try:
            done = model.step(batch, on_text)
        except REDIS_OUTAGE:
            raise  # a streamed delta could not be pushed: the serving loop rides the outage out
        except Exception as exc:
            log.exception("a decode step of %d rows failed", len(batch.rows))
            for row in batch.rows:
                self._fail(row.key, exc)
            batch.keep([])
            return
        end = time.time()
        for p, result in done.items():
            assert p.gen is not None
            self._push(
                p,
                {
                    "type": "done",
                    "text": result.text,
                    "finish_reason": result.finish_reason,
                    "prompt_tokens": len(p.gen.prompt_ids),
                    "completion_tokens": result.completion_tokens,
                    # logprobs of every token (a stream's deltas carried those up to logprobs_sent)
                    "logprobs": (
                        [_logprob_json(model, t) for t in result.logprobs]
                        if p.gen.top_logprobs is not None
                        else None
                    ),
                    **tool_answer(model, p.raw, result),
                },
            )
            self.metrics.requests.labels("ok").inc()
            self.metrics.tokens.labels(base).inc(result.completion_tokens)
            if p.first_token_at is not None and result.completion_tokens > 1 and end > p.first_token_at:
                rate = (result.completion_tokens - 1) / (end - p.first_token_at)
                self.metrics.tokens_per_s.labels(base).observe(rate)

    # -- replies
    def _push(self, p: Pending, event: dict[str, Any]) -> None:
        key = reply_key(p.raw["id"])
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(key, json.dumps(event))
        pipe.expire(key, REPLY_TTL_SECONDS)
        pipe.execute()

    def _fail(self, p: Pending, exc: BaseException) -> None:
        if isinstance(exc, EngineError):
            event = {
                "type": "error",
                "status": 400,
                "code": exc.code,
                "param": exc.param,
                "message": str(exc),
            }
            self.metrics.requests.labels("invalid").inc()
        else:
            log.error("inference request %s failed", p.raw.get("id"), exc_info=exc)
            event = {
                "type": "error",
                "status": 500,
                "code": "inference_error",
                "param": None,
                "message": f"the inference worker failed: {type(exc).__name__}",
            }
            self.metrics.requests.labels("error").inc()
        self._push(p, event)


class StartingBeat:
    """A thread that marks the worker as starting (service.inference.starting_key) from its first
    moment (before torch is imported and its models preloaded) until it is in the workers zset,
    then removes the mark: a chat request that comes meanwhile waits for the worker instead of
    being told to start one. A worker that dies while starting drops out after
    `WORKER_ALIVE_SECONDS`."""

    def __init__(self, worker: InferenceWorker) -> None:
        self.worker = worker
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inference-starting", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        from redis.exceptions import RedisError

        w = self.worker
        try:
            while not self._stop.is_set():
                with contextlib.suppress(RedisError):
                    if w.redis.zscore(workers_key(w.queue), w.worker_id) is not None:
                        return
                    mark_starting(w.redis, w.queue, w.worker_id)
                self._stop.wait(HEARTBEAT_SECONDS)
        finally:
            with contextlib.suppress(RedisError):
                w.redis.zrem(starting_key(w.queue), w.worker_id)


def run_inference_worker(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code."""
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = InferenceWorker(settings)
    starting = StartingBeat(worker)
    starting.start()

    def on_signal(_signum: int, _frame: object) -> None:
        worker.stop()
        starting.stop()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    worker.serve_forever()
    log.info("inference worker stopped")
    return 0


def _trained_part(
    examples: Examples, report: dict[str, Any], tokenizer: Any, raw: dict[str, Any]
) -> dict[str, Any]:
    """What the job trains on and how: the training file's valid examples less the validation
    holdout, the run planned from them ("auto" resolved) and formed into rows, all by the engine's
    own `planned_datasets` (the holdout drawn with the job's seed)."""
    from worker.engine.data import planned_datasets
    from worker.engine.training_config import TrainingConfig, plan_job, plan_sentence, plan_steps

    training = TrainingConfig(**raw["training"])
    if report["format"] is None:  # no valid example: nothing to train on
        return {
            **dict.fromkeys(
                ["examples", "tokens", "trainable_tokens", "rows", "longest_row", "held_out_examples"], 0
            ),
            "plan": None,
        }
    planned = planned_datasets(
        examples,
        tokenizer,
        training.max_seq_len,
        report["format"],
        pack=training.packing,
        holdout=float(raw["validation_split"]),
        seed=int(raw["seed"]),
        planner=lambda shape: plan_job(training, shape, world_size=int(raw["n_gpus"])),
    )
    train, held, plan = planned.train, planned.held_out, planned.plan
    steps = plan_steps(
        len(train.rows), batch_size=plan.global_batch, n_epochs=plan.n_epochs, grad_accum=training.grad_accum
    ).steps
    return {
        "examples": train.examples,
        "tokens": train.tokens,
        "trainable_tokens": train.trainable_tokens,
        "rows": len(train.rows),
        "longest_row": train.rows.longest(),
        "held_out_examples": held.examples if held is not None else 0,
        "plan": {
            "hyperparameters": plan.hyperparameters(),
            "row_tokens": plan.row_tokens,
            "global_batch_size": plan.global_batch,  # rows a micro-batch over all GPUs (per_gpu: × GPUs)
            "learning_rate": plan.learning_rate,  # the peak rate the run trains at
            "message": plan_sentence(planned.shape, rows=len(train.rows), steps=steps, plan=plan),
        },
    }


def _logprob_json(model: ServingModel, t: TokenLogprob) -> dict[str, Any]:
    """One token's logprobs as OpenAI's `choices[].logprobs.content[]` entry."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = str(model.tokenizer.decode([token_id]))
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {**entry(t.token_id, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}


def tool_answer(model: ServingModel, raw: dict[str, Any], result: GenResult) -> dict[str, Any]:
    """What a request with tools gets instead of the plain text: the calls the answer makes, in
    the model's tool-call format (worker/engine/tool_calls.py), the rest as its content, and
    finish_reason "tool_calls" when it made some. Its text was not streamed (`buffered`)."""
    tools = raw.get("tools")
    if not tools or model.tool_format is None:
        return {}
    content, calls = parse_tool_calls(result.text, model.tool_format, tools)
    return {
        "text": content,
        "tool_calls": calls,
        "finish_reason": "tool_calls" if calls else result.finish_reason,
        "buffered": bool(raw.get("stream")),
    }
