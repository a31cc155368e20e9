"""`loraq inference`: the worker that serves chat completions (protocol: service/inference.py).

One process, one loop: pop a request (BLPOP), drain whatever else is waiting (up to
`inference_max_batch`), group the requests by base model, and decode each group as one batch in
which every row carries its adapter's slot (worker.engine.serving). Base models stay loaded
(an LRU of `inference_max_models`), adapters are loaded from the store on first use and kept in
an LRU of `inference_max_adapters` slots per base model.

Prometheus (own registry, port `inference_metrics_port`): time to first token, generated tokens/s
per request, requests by outcome.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import zipfile
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

from service.inference import REPLY_TTL_SECONDS, reply_key, requests_key, workers_key
from service.settings import Settings
from worker.celery_app import broker_url
from worker.engine.types import EngineError

if TYPE_CHECKING:
    from worker.engine.serving import Adapter, GenRequest, ServingModel

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


@dataclass
class Pending:
    """One request of a batch: the protocol fields and its decoding state."""

    raw: dict[str, Any]
    pushed_at: float
    gen: GenRequest | None = None
    first_token_at: float | None = None
    pieces: list[str] = field(default_factory=list)


class InferenceWorker:
    def __init__(self, settings: Settings, worker_id: str | None = None) -> None:
        self.settings = settings
        self.queue = settings.inference_queue
        self.worker_id = worker_id or f"{socket.gethostname()}:{os.getpid()}"
        self.redis = redis.Redis.from_url(broker_url(settings))
        self.models: OrderedDict[str, ServingModel] = OrderedDict()
        self._tokenizers: dict[str, Any] = {}
        self.metrics = Metrics()
        self._stop = threading.Event()

    # -- lifecycle
    def start(self) -> None:
        import torch

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
        threading.Thread(target=self._heartbeat, name="inference-heartbeat", daemon=True).start()
        log.info("inference worker %s ready on queue %s", self.worker_id, self.queue)

    def stop(self) -> None:
        self._stop.set()

    def _heartbeat(self) -> None:
        key = workers_key(self.queue)
        while not self._stop.is_set():
            try:
                self.redis.zadd(key, {self.worker_id: time.time()})
            except redis.exceptions.RedisError:
                log.warning("inference heartbeat failed", exc_info=True)
            self._stop.wait(HEARTBEAT_SECONDS)

    def serve_forever(self) -> None:
        self.start()
        while not self._stop.is_set():
            try:
                self.serve_once(POP_TIMEOUT_SECONDS)
            except redis.exceptions.ConnectionError:
                log.warning("Redis unreachable; retrying", exc_info=True)
                time.sleep(1.0)
        self.redis.zrem(workers_key(self.queue), self.worker_id)

    def serve_once(self, timeout: float) -> int:
        """Pop and answer one batch; returns how many requests it held."""
        key = requests_key(self.queue)
        item = self.redis.blpop([key], timeout=timeout)
        if item is None:
            return 0
        raws = [item[1], *(self.redis.lpop(key, self.settings.inference_max_batch - 1) or [])]
        batch = [Pending(raw=(raw := json.loads(r)), pushed_at=float(raw["sent_at"])) for r in raws]
        now = time.time()
        live = []
        for p in batch:
            if float(p.raw["deadline"]) < now:  # the API has given up on it
                self.metrics.requests.labels("expired").inc()
            else:
                live.append(p)
        by_base: dict[str, list[Pending]] = {}
        for p in live:
            if p.raw.get("kind") == "dry_run":
                self._dry_run(p)
            else:
                by_base.setdefault(p.raw["base"], []).append(p)
        for base, group in by_base.items():
            self._run_group(base, group)
        return len(batch)

    # -- models and adapters
    def model(self, name: str) -> ServingModel:
        if name in self.models:
            self.models.move_to_end(name)
            return self.models[name]
        from worker.engine.serving import load_serving_model

        while len(self.models) >= self.settings.inference_max_models:
            evicted, _ = self.models.popitem(last=False)
            log.info("unloaded base model %s", evicted)
        started = time.monotonic()
        self.models[name] = load_serving_model(
            name, store=self.settings.model_store, max_adapters=self.settings.inference_max_adapters
        )
        log.info("loaded base model %s in %.1fs", name, time.monotonic() - started)
        return self.models[name]

    def read_adapter(self, key: str, sha256: str) -> Adapter:
        from safetensors.torch import load as load_safetensors

        from service.storage import FileStore
        from worker.engine.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
        from worker.engine.serving import Adapter

        path = FileStore(self.settings.artifact_dir).verify(key, sha256)
        with zipfile.ZipFile(path) as zf:
            config = json.loads(zf.read(ADAPTER_CONFIG))
            tensors = load_safetensors(zf.read(ADAPTER_WEIGHTS))
        return Adapter(config=config, tensors=tensors)

    def tokenizer(self, name: str) -> Any:
        """A loaded model's tokenizer, else the tokenizer alone (cached; no weights loaded)."""
        if name in self.models:
            return self.models[name].tokenizer
        if name not in self._tokenizers:
            from worker.engine.models import load_tokenizer

            self._tokenizers[name] = load_tokenizer(name, store=self.settings.model_store)
        return self._tokenizers[name]

    # -- a job's dry run: tokenize its files as the job would (service/dry_run.py plans the rest)
    def _dry_run(self, p: Pending) -> None:
        from service.storage import FileStore
        from worker.engine.data import validate_dataset

        store = FileStore(self.settings.artifact_dir)
        try:
            tokenizer = self.tokenizer(p.raw["base"])
            max_seq_len = int(p.raw["max_seq_len"])
            reports: dict[str, Any] = {}
            for name in ("training_file", "validation_file"):
                key = p.raw.get(name)  # a store key, or None (no validation file)
                reports[name] = (
                    asdict(validate_dataset(store.path(key), tokenizer, max_seq_len)) if key else None
                )
        except Exception as exc:
            self._fail(p, exc)
            return
        self.metrics.requests.labels("dry_run").inc()
        self._push(p, {"type": "done", **reports})

    # -- one group of requests on one base model
    def _run_group(self, base: str, group: list[Pending]) -> None:
        try:
            model = self.model(base)
        except Exception as exc:
            for p in group:
                self._fail(p, exc)
            return
        # Sub-batches whose distinct adapters fit the slots (a batch pins the slots it uses).
        while group:
            batch, group = self._admit(model, group)
            if batch:
                self._decode(model, base, batch)

    def _admit(self, model: ServingModel, group: list[Pending]) -> tuple[list[Pending], list[Pending]]:
        from worker.engine.serving import GenRequest

        admitted: list[Pending] = []
        later: list[Pending] = []
        pinned: set[int] = set()
        for p in group:
            key = p.raw.get("adapter_key")
            if (
                key
                and key not in model.loaded_adapters
                and len(pinned) >= self.settings.inference_max_adapters
            ):
                later.append(p)
                continue
            try:
                slot = 0
                if key:
                    sha256 = str(p.raw["adapter_sha256"])
                    slot = model.adapter_slot(key, partial(self.read_adapter, key, sha256), keep=pinned)
                    pinned.add(slot)
                ids = model.prompt_ids(p.raw["messages"])
                max_tokens = p.raw.get("max_tokens") or max(1, model.max_context - len(ids))
                model.check_fits(len(ids), max_tokens)
            except Exception as exc:
                self._fail(p, exc)
                continue
            p.gen = GenRequest(
                prompt_ids=ids,
                max_tokens=max_tokens,
                slot=slot,
                temperature=float(p.raw.get("temperature", 1.0)),
                top_p=float(p.raw.get("top_p", 1.0)),
                seed=None if p.raw.get("seed") is None else int(p.raw["seed"]) % 2**63,
                stop=list(p.raw.get("stop") or []),
            )
            self._push(p, {"type": "start", "prompt_tokens": len(ids)})
            admitted.append(p)
        return admitted, later

    def _decode(self, model: ServingModel, base: str, batch: list[Pending]) -> None:
        def on_text(i: int, delta: str) -> None:
            p = batch[i]
            if p.first_token_at is None:
                p.first_token_at = time.time()
                self.metrics.ttft.labels(base).observe(p.first_token_at - p.pushed_at)
            if delta and p.raw.get("stream"):
                self._push(p, {"type": "delta", "text": delta})

        try:
            results = model.generate([p.gen for p in batch if p.gen is not None], on_text)
        except Exception as exc:
            log.exception("decoding a batch of %d failed", len(batch))
            for p in batch:
                self._fail(p, exc)
            return
        end = time.time()
        for p, r in zip(batch, results, strict=True):
            assert p.gen is not None
            self._push(
                p,
                {
                    "type": "done",
                    "text": r.text,
                    "finish_reason": r.finish_reason,
                    "prompt_tokens": len(p.gen.prompt_ids),
                    "completion_tokens": r.completion_tokens,
                },
            )
            self.metrics.requests.labels("ok").inc()
            self.metrics.tokens.labels(base).inc(r.completion_tokens)
            if p.first_token_at is not None and r.completion_tokens > 1 and end > p.first_token_at:
                rate = (r.completion_tokens - 1) / (end - p.first_token_at)
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


def run_inference_worker(settings: Settings) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code."""
    import signal

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    worker = InferenceWorker(settings)

    def on_signal(_signum: int, _frame: object) -> None:
        worker.stop()

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, on_signal)
    worker.serve_forever()
    log.info("inference worker stopped")
    return 0
