"""Worker metrics for Prometheus, and the worker registry the dashboard's Workers page reads.

Process model: the worker's main process serves `/metrics` on `settings.worker_metrics_port`
(started by Celery's `worker_init`, before any pool forks). `loraq worker` runs jobs in that same
process (solo pool); with a prefork pool they run in a child. Either way the training counters and
histograms go through prometheus_client's multiprocess mode: every process writes its values to
mmap files under `PROMETHEUS_MULTIPROC_DIR` and the main process's `MultiProcessCollector` merges
them at scrape time. Per-job gauges (labelled `job_id`) go through small live-job files instead
(see `LIVE_JOB_GAUGES`), so that they disappear after the job. GPU series are read from NVML at
scrape time by `NvmlCollector`; on a host without NVML it yields nothing.

Registry (Redis; key names in `service.worker_registry`, read by the dashboard and the API):
- `loraq:workers:<node>`      JSON: hostname, pid, metrics port, queue, kernels, GPUs, last_seen;
                              refreshed every `REGISTRY_INTERVAL_SECONDS` by a thread of the main
                              process, expires after `REGISTRY_TTL_SECONDS` without a refresh.
- `loraq:workers:<node>:job`  JSON: the job the worker runs (id, model, step, total), written by
                              the pool child; deleted when the job ends.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import redis

from service.redis_client import redis_client
from service.settings import Settings, get_settings
from service.worker_registry import job_key, worker_key
from worker.engine.types import StepMetrics

log = logging.getLogger("loraq.worker.metrics")

REGISTRY_INTERVAL_SECONDS = 5.0
REGISTRY_TTL_SECONDS = 30
JOB_KEY_TTL_SECONDS = 120
JOB_KEY_REFRESH_SECONDS = 2.0
# Not a setting: the main process sets it for its pool children (forked after the settings were
# read), so that they write the registry entry of the node that serves their metrics.
NODE_ENV = "LORAQ_WORKER_NODE"
STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_SECONDS_BUCKETS = (1, 5, 15, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 48 * 3600)


# --------------------------------------------------------------------------- GPUs (NVML)
@dataclass
class GpuSample:
    index: int
    uuid: str
    name: str
    utilization_percent: float
    memory_used_bytes: float
    memory_total_bytes: float
    temperature_celsius: float
    power_watts: float
    sm_clock_hertz: float


class NvmlLike(Protocol):
    """The few `pynvml` functions we call (the module itself satisfies this)."""

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str: ...
    def nvmlDeviceGetName(self, handle: Any) -> str: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int: ...
    def nvmlDeviceGetClockInfo(self, handle: Any, clock_type: int) -> int: ...


NVML_TEMPERATURE_GPU = 0  # pynvml.NVML_TEMPERATURE_GPU
NVML_CLOCK_SM = 1  # pynvml.NVML_CLOCK_SM

_nvml_lock = threading.Lock()
_nvml_state: dict[str, Any] = {}  # "module": initialised pynvml, or "error": why it is unusable


def load_nvml() -> NvmlLike | None:
    """Initialise NVML once per process; None (and one log line) when the host has none."""
    with _nvml_lock:
        if "module" in _nvml_state:
            return _nvml_state["module"]
        if "error" in _nvml_state:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, NVMLError_LibraryNotFound, NVMLError_DriverNotLoaded...
            _nvml_state["error"] = str(e) or type(e).__name__
            log.info("NVML unavailable (%s): no GPU metrics on this host", _nvml_state["error"])
            return None
        _nvml_state["module"] = pynvml
        return pynvml


def owned_gpu_indices() -> set[int] | None:
    """Host GPU indices this worker owns, or None for all of them.

    NVML sees every GPU of the host whatever CUDA_VISIBLE_DEVICES says, so a worker pinned to one
    GPU must filter, or each worker of a host would report every GPU as its own.
    """
    # LORAQ_WORKER_GPUS, set by worker.launcher per child ("2" or "2,3"), else CUDA's own variable
    for raw in (get_settings().worker_gpus or "", os.environ.get("CUDA_VISIBLE_DEVICES", "")):
        raw = raw.strip()
        if raw and all(p.strip().isdigit() for p in raw.split(",")):
            return {int(p) for p in raw.split(",")}
    return None  # unset, "all", or UUIDs: report every GPU


def read_gpus(nvml: NvmlLike) -> list[GpuSample]:
    """One sample per owned GPU. A GPU whose reading fails is skipped, the others still reported."""
    samples = []
    owned = owned_gpu_indices()
    for index in range(nvml.nvmlDeviceGetCount()):
        if owned is not None and index not in owned:
            continue
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(index)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            samples.append(
                GpuSample(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    utilization_percent=float(nvml.nvmlDeviceGetUtilizationRates(h).gpu),
                    memory_used_bytes=float(mem.used),
                    memory_total_bytes=float(mem.total),
                    temperature_celsius=float(nvml.nvmlDeviceGetTemperature(h, NVML_TEMPERATURE_GPU)),
                    power_watts=nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # NVML reports milliwatts
                    sm_clock_hertz=nvml.nvmlDeviceGetClockInfo(h, NVML_CLOCK_SM) * 1e6,  # MHz
                )
            )
        except Exception:
            log.warning("NVML: reading GPU %d failed", index, exc_info=True)
    return samples


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def local_gpus() -> list[GpuSample]:
    nvml = load_nvml()
    return read_gpus(nvml) if nvml is not None else []


class NvmlCollector:
    """Custom collector: per-GPU gauges read from NVML at scrape time; nothing without NVML."""

    GAUGES = (
        ("loraq_gpu_utilization_percent", "GPU utilisation, last sample period", "utilization_percent"),
        ("loraq_gpu_memory_used_bytes", "GPU memory in use", "memory_used_bytes"),
        ("loraq_gpu_memory_total_bytes", "GPU memory installed", "memory_total_bytes"),
        ("loraq_gpu_temperature_celsius", "GPU core temperature", "temperature_celsius"),
        ("loraq_gpu_power_watts", "GPU power draw", "power_watts"),
        ("loraq_gpu_sm_clock_hertz", "GPU SM clock", "sm_clock_hertz"),
    )

    def __init__(self, nvml: NvmlLike | None = None, *, node: str = "") -> None:
        self._nvml = nvml
        self._node = node

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        nvml = self._nvml if self._nvml is not None else load_nvml()
        if nvml is None:
            return
        samples = read_gpus(nvml)
        if not samples:
            return
        labels = ["worker", "gpu", "uuid", "name"]
        for metric, doc, attr in self.GAUGES:
            family = GaugeMetricFamily(metric, doc, labels=labels)
            for s in samples:
                family.add_metric([self._node, str(s.index), s.uuid, s.name], float(getattr(s, attr)))
            yield family


# --------------------------------------------------------------------------- training metrics
def prepare_multiprocess_dir(path: Path) -> None:
    """Point prometheus_client at a fresh multiprocess directory, before any metric exists.

    prometheus_client picks its value class when it is first imported; if something imported it
    before this ran, rebind the class so that the metrics created later write to mmap files.
    """
    shutil.rmtree(path, ignore_errors=True)  # stale files from a previous run would be merged in
    path.mkdir(parents=True, exist_ok=True)
    # prometheus_client's own variable (not a setting): it and the pool children read it from here
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)
    from prometheus_client import values

    values.ValueClass = values.get_value_class()


class TrainingMetrics:
    """The training series. Created lazily per process (after `prepare_multiprocess_dir`)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.compiled_kernels = Gauge(
            "loraq_gpu_kernels_compiled",
            "1 when the compiled CUDA LoRA kernels are in use, 0 on the reference path",
            multiprocess_mode="livemax",
        )
        self.running_jobs = Gauge("loraq_worker_running_jobs", "Jobs running", multiprocess_mode="livesum")
        self.steps = Counter("loraq_train_steps", "Optimizer steps taken")
        self.clipped_steps = Counter("loraq_train_clipped_steps", "Steps whose gradient norm was clipped")
        self.tokens = Counter("loraq_train_tokens", "Tokens trained on")
        self.step_seconds = Histogram(
            "loraq_train_step_seconds", "Wall time of one optimizer step", buckets=STEP_SECONDS_BUCKETS
        )
        self.job_seconds = Histogram(
            "loraq_job_duration_seconds",
            "Wall time of one job attempt on this worker, by outcome",
            ["outcome"],
            buckets=JOB_SECONDS_BUCKETS,
        )
        self.jobs_finished = Counter("loraq_jobs_finished", "Job attempts finished, by outcome", ["outcome"])


# Per-job gauges (loss, grad norm, ...) exist while the job runs and for LIVE_JOB_GRACE_SECONDS
# after. prometheus_client cannot remove a labelled series in multiprocess mode (they would be
# exported forever), so these do not go through its mmap files: the process running a job writes
# them to `live-job-<pid>.json` in the multiprocess directory after every step (atomic rename) and
# marks the file finished at the end; `LiveJobCollector` in the serving process turns the files
# into gauges at scrape time and deletes those finished more than the grace period ago.
LIVE_JOB_GAUGES = (  # (metric, help, state key, labels)
    ("loraq_train_loss", "Training loss of the last step", "train_loss", ("job_id", "model")),
    ("loraq_train_valid_loss", "Last validation loss", "valid_loss", ("job_id", "model")),
    ("loraq_train_grad_norm", "Gradient norm of the last step, before clipping", "grad_norm", ("job_id",)),
    ("loraq_train_learning_rate", "Learning rate of the last step", "lr", ("job_id",)),
    ("loraq_train_tokens_per_second", "Training throughput", "tokens_per_s", ("job_id",)),
    ("loraq_train_step", "Optimizer step reached", "step", ("job_id",)),
    ("loraq_train_total_steps", "Optimizer steps planned", "total_steps", ("job_id",)),
    (
        "loraq_train_clip_rate",
        "Fraction of the job's steps whose gradient norm exceeded max_grad_norm",
        "clip_rate",
        ("job_id",),
    ),
)
LIVE_JOB_GLOB = "live-job-*.json"
LIVE_JOB_GRACE_SECONDS = 60.0


def live_job_path(pid: int | None = None) -> Path | None:
    """This process's live-job file, or None when no metrics server set a multiprocess dir."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory:
        return None
    return Path(directory) / f"live-job-{os.getpid() if pid is None else pid}.json"


def write_live_job(state: dict[str, Any]) -> None:
    path = live_job_path()
    if path is None:
        return
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(path)  # a scrape never reads half a file


def finish_live_job() -> None:
    """Mark this process's live job finished: its final values stay scrapeable for a grace period
    (so a 15 s scrape still sees the last loss and the final validation loss), then go."""
    path = live_job_path()
    if path is None:
        return
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    write_live_job({**state, "finished_at": time.time()})


def clear_live_job(pid: int | None = None) -> None:
    path = live_job_path(pid)
    if path is not None:
        path.unlink(missing_ok=True)


class LiveJobCollector:
    """Gauges of the jobs running now, from the live-job files of this worker's processes."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        states = []
        now = time.time()
        for path in sorted(self.directory.glob(LIVE_JOB_GLOB)):
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):  # removed or replaced between glob and read
                continue
            if now - state.get("finished_at", now) > LIVE_JOB_GRACE_SECONDS:
                path.unlink(missing_ok=True)
                continue
            states.append(state)
        if not states:
            return
        for metric, doc, key, labels in LIVE_JOB_GAUGES:
            family = GaugeMetricFamily(metric, doc, labels=list(labels))
            for st in states:
                if st.get(key) is not None:
                    family.add_metric([str(st[label]) for label in labels], float(st[key]))
            yield family


_training: TrainingMetrics | None = None
_training_lock = threading.Lock()


def training_metrics() -> TrainingMetrics:
    global _training
    with _training_lock:
        if _training is None:
            _training = TrainingMetrics()
        return _training


@dataclass
class _JobState:
    job_id: str
    model: str
    started: float
    max_grad_norm: float
    steps: int = 0
    clipped: int = 0
    valid_loss: float | None = None  # the last one seen: validation runs only every few steps
    job_key_written: float = float("-inf")


# Jobs started in this process and not finished yet, by id (one at a time with one job per GPU).
_active: dict[str, _JobState] = {}


# The three hooks below are what `worker.runner` / `worker.tasks` call. They never raise: a metrics
# or registry failure must not fail a training run.
def job_started(job_id: str, *, model: str, max_grad_norm: float) -> None:
    try:
        state = _JobState(job_id, model, time.monotonic(), max_grad_norm)
        _active[job_id] = state
        m = training_metrics()
        m.running_jobs.inc()
        m.compiled_kernels.set(1.0 if kernels_status()["compiled"] else 0.0)
        _write_job_key(state, step=0, total=0)
    except Exception:
        log.warning("metrics: job_started failed", exc_info=True)


def observe_step(job_id: str, metrics: StepMetrics) -> None:
    s = _active.get(job_id)
    if s is None:
        return
    try:
        m = training_metrics()
        s.steps += 1
        clipped = s.max_grad_norm > 0 and metrics.grad_norm > s.max_grad_norm
        s.clipped += int(clipped)
        write_live_job(
            {
                "job_id": job_id,
                "model": s.model,
                "train_loss": metrics.train_loss,
                "valid_loss": metrics.valid_loss if metrics.valid_loss is not None else s.valid_loss,
                "grad_norm": metrics.grad_norm,
                "lr": metrics.lr,
                "tokens_per_s": metrics.tokens_per_s,
                "step": metrics.step,
                "total_steps": metrics.total_steps,
                "clip_rate": s.clipped / s.steps,
            }
        )
        if metrics.valid_loss is not None:
            s.valid_loss = metrics.valid_loss
        m.steps.inc()
        if clipped:
            m.clipped_steps.inc()
        m.tokens.inc(metrics.tokens)
        m.step_seconds.observe(metrics.step_seconds)
        if time.monotonic() - s.job_key_written >= JOB_KEY_REFRESH_SECONDS:
            _write_job_key(s, step=metrics.step, total=metrics.total_steps)
    except Exception:
        log.warning("metrics: observe_step failed", exc_info=True)


def active_job(default: str) -> str:
    """The job this process is training (one at a time), else `default`: a delivery of one job's
    message may claim another (fair share, `service.jobs.claim_next`)."""
    return next(iter(_active), default)


def job_finished(job_id: str, outcome: str) -> None:
    """Count the attempt's outcome; its duration when training had started in this process."""
    s = _active.pop(job_id, None)
    try:
        if s is not None:
            finish_live_job()
        m = training_metrics()
        m.jobs_finished.labels(outcome).inc()
        if s is not None:
            m.job_seconds.labels(outcome).observe(time.monotonic() - s.started)
            m.running_jobs.dec()
    except Exception:
        log.warning("metrics: job_finished failed", exc_info=True)
    if s is not None and os.environ.get(NODE_ENV):
        try:
            _redis().delete(job_key(node_id()))
        except Exception:
            log.warning("registry: could not clear the current job", exc_info=True)


def _write_job_key(s: _JobState, *, step: int, total: int) -> None:
    s.job_key_written = time.monotonic()
    if not os.environ.get(NODE_ENV):  # not inside a started worker (a test calling the runner)
        return
    body = {"job_id": s.job_id, "model": s.model, "step": step, "total_steps": total, "pid": os.getpid()}
    try:
        _redis().set(job_key(node_id()), json.dumps(body), ex=JOB_KEY_TTL_SECONDS)
    except Exception:
        log.warning("registry: could not record the current job", exc_info=True)


# --------------------------------------------------------------------------- registry
def node_id() -> str:
    """This worker's id: set by the main process before the pool forks, so children share it."""
    return os.environ.get(NODE_ENV) or f"{socket.gethostname()}:{os.getpid()}"


_redis_client: redis.Redis | None = None


def _redis(settings: Settings | None = None) -> redis.Redis:
    global _redis_client
    if _redis_client is None:
        _redis_client = redis_client(settings or get_settings())
    return _redis_client


_kernels: dict[str, Any] = {}


def kernels_status() -> dict[str, Any]:
    """`gpu_kernels.available()` as JSON, cached: whether the compiled kernels are in use."""
    if not _kernels:
        try:
            import gpu_kernels

            status = gpu_kernels.available()
            _kernels.update(compiled=bool(status.compiled), reason=status.reason)
        except Exception as e:
            _kernels.update(compiled=False, reason=f"gpu_kernels failed to load: {e}")
    return dict(_kernels)


def registry_entry(*, node: str, metrics_port: int | None, queue: str, started_at: float) -> dict[str, Any]:
    return {
        "node": node,
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "queue": queue,
        "metrics_port": metrics_port,
        "started_at": started_at,
        "last_seen": time.time(),
        "kernels": kernels_status(),
        "gpus": [asdict(g) for g in local_gpus()],
    }


class RegistryBeat:
    """Thread of the main worker process: refresh `loraq:workers:<node>` until stopped."""

    def __init__(self, *, node: str, metrics_port: int | None, settings: Settings) -> None:
        self.node = node
        self.metrics_port = metrics_port
        self.settings = settings
        self.started_at = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loraq-registry", daemon=True)

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self) -> None:
        entry = registry_entry(
            node=self.node,
            metrics_port=self.metrics_port,
            queue=self.settings.worker_queue,
            started_at=self.started_at,
        )
        _redis(self.settings).set(worker_key(self.node), json.dumps(entry), ex=REGISTRY_TTL_SECONDS)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        try:
            _redis(self.settings).delete(worker_key(self.node), job_key(self.node))
        except Exception:
            log.warning("registry: could not remove %s", self.node, exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(REGISTRY_INTERVAL_SECONDS):
            try:
                self.beat()
            except Exception:  # Redis blip: the next beat retries; the entry expires meanwhile
                log.warning("registry beat failed", exc_info=True)


# --------------------------------------------------------------------------- server
@dataclass
class WorkerMetricsServer:
    node: str
    port: int
    multiproc_dir: Path
    beat: RegistryBeat
    httpd: Any

    def stop(self) -> None:
        self.beat.stop()
        self.httpd.shutdown()
        self.httpd.server_close()
        shutil.rmtree(self.multiproc_dir, ignore_errors=True)  # this worker's values die with it


def start_worker_metrics(settings: Settings | None = None, *, port: int | None = None) -> WorkerMetricsServer:
    """In the worker's main process, before the pool forks: multiprocess dir, HTTP server, registry.

    `port` 0 picks a free port (the chosen one is in the registry entry and the return value).
    """
    settings = settings or get_settings()
    node = f"{socket.gethostname()}:{os.getpid()}"
    os.environ[NODE_ENV] = node  # inherited by the pool children
    multiproc_dir = settings.resolved_data_dir / "prometheus" / f"worker-{os.getpid()}"
    prepare_multiprocess_dir(multiproc_dir)

    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(multiproc_dir))
    registry.register(LiveJobCollector(multiproc_dir))
    registry.register(NvmlCollector(node=node))
    bind_port = settings.worker_metrics_port if port is None else port
    host = settings.worker_metrics_host or settings.host
    try:
        httpd, _thread = start_http_server(bind_port, addr=host, registry=registry)
    except OSError as e:
        # Another worker on this host holds the port: serve on a free one rather than not at
        # all; the registry entry (Workers page) names the port actually used.
        log.warning("worker metrics port %d unavailable (%s); using a free port", bind_port, e)
        httpd, _thread = start_http_server(0, addr=host, registry=registry)
    actual_port = int(httpd.server_port)
    # The main process's own gauge: so the series exists before the first job runs.
    training_metrics().compiled_kernels.set(1.0 if kernels_status()["compiled"] else 0.0)
    beat = RegistryBeat(node=node, metrics_port=actual_port, settings=settings)
    beat.start()
    log.info("worker metrics on http://%s:%d/metrics (node %s)", host, actual_port, node)
    return WorkerMetricsServer(node, actual_port, multiproc_dir, beat, httpd)


def mark_child_dead(pid: int) -> None:
    """Drop a dead pool child's live gauges and live-job file (Celery's worker_process_shutdown)."""
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)
        clear_live_job(pid)  # a child killed mid-job never deleted its file


# --------------------------------------------------------------------------- Celery signal hooks
_server: WorkerMetricsServer | None = None


def on_worker_init() -> None:
    """Celery `worker_init` (main process, before the pool forks). A failure only loses metrics."""
    global _server
    try:
        _server = start_worker_metrics()
    except Exception:
        log.exception("worker metrics could not start; the worker runs without /metrics")


def on_worker_shutdown() -> None:
    """Celery `worker_shutdown`: stop serving and drop this worker's registry entry."""
    global _server
    if _server is not None:
        try:
            _server.stop()
        except Exception:
            log.warning("worker metrics did not stop cleanly", exc_info=True)
        _server = None


def on_pool_process_exit(pid: int) -> None:
    """Celery `worker_process_shutdown`: a pool child exits; its live gauges must go with it."""
    try:
        mark_child_dead(pid)
    except Exception:
        log.warning("could not mark pool process %d dead", pid, exc_info=True)
