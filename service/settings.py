"""The one configuration object. Every knob is an environment variable `LORAQ_<NAME>`.

No other module reads a `LORAQ_` variable (tests/service/test_settings.py checks it): the API, the
workers, the CLI, bench/ and scripts/ take their values from `get_settings()`, and gpu_kernels
(which imports only torch) gets its switches passed down (`worker.kernels.configure_kernels`).
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, IPvAnyNetwork
from pydantic_settings import BaseSettings, SettingsConfigDict

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The broker's Redis when LORAQ_REDIS_URL is unset (outside `loraq up`, which starts its own).
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def default_data_dir() -> Path:
    """`var/` of the source checkout this package runs from (`make up`, an editable install), or the
    user's data dir (`$XDG_DATA_HOME/loraq`, else ~/.local/share/loraq) for an installed wheel. Never
    the current directory: every command finds the same database and models wherever it is run."""
    if (PROJECT_ROOT / "pyproject.toml").is_file() and (PROJECT_ROOT / "service").is_dir():
        return PROJECT_ROOT / "var"
    xdg = os.environ.get("XDG_DATA_HOME")  # the XDG base-directory convention, not a Loraq setting
    return (Path(xdg) if xdg else Path.home() / ".local" / "share") / "loraq"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="LORAQ_", extra="ignore")

    data_dir: Path = Field(default_factory=default_data_dir)  # a relative LORAQ_DATA_DIR is the user's
    database_url: str | None = None  # default: sqlite under data_dir
    redis_url: str | None = None  # unset: `loraq up` starts its own redis-server
    host: str = "127.0.0.1"
    port: int = 8000
    api_workers: int = Field(1, ge=1, le=64)  # uvicorn worker processes `loraq up` starts
    # The API's HTTP server (`loraq api`, service/api_server.py) bounds what one connection costs,
    # per API process: a request's line and headers (431 past either size, checked as the bytes
    # arrive), how long its head may take to arrive (then 408), how long its body may stall and
    # how long a kept-alive connection may idle (then closed), and how many connections are open
    # at once (503 beyond; capped at half the process's file-descriptor limit).
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    max_request_head_bytes: int = Field(64 * 1024, ge=4096)
    header_timeout_seconds: float = Field(10.0, gt=0)
    body_idle_timeout_seconds: float = Field(30.0, gt=0)
    keep_alive_timeout_seconds: int = Field(5, ge=1)
    max_connections: int = Field(1000, ge=1)
    # Proxies whose X-Forwarded-For/-Proto the API believes (uvicorn's forwarded_allow_ips).
    forwarded_allow_ips: str = "127.0.0.1"
    api_key: str | None = None  # accepted for the default tenant by `loraq up`
    secret_key: str | None = None  # HMAC key for stored API-key hashes; generated under data_dir if unset
    cors_origins: list[str] = Field(default_factory=list)
    migrate_on_start: bool = False  # the API runs `alembic upgrade head` when it starts

    max_upload_bytes: int = 512 * 1024 * 1024
    # Uploads are validated line by line: a longer line is a bad line, never read whole.
    max_line_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    # A submit counts a file's tokens (the max_seq_len check) for at most this long; a file that
    # needs longer is counted in the background, its job `validating_files` meanwhile.
    submit_count_seconds: float = Field(1.5, ge=0)
    max_queued_jobs_per_tenant: int = 20
    max_running_jobs_per_tenant: int = 4
    rate_limit_per_minute: int = 6000

    job_max_steps: int = 100_000
    job_max_tokens: int = 10_000_000_000
    job_max_wall_seconds: float = 7 * 24 * 3600.0
    heartbeat_seconds: float = 5.0
    heartbeat_timeout_seconds: float = 60.0
    max_attempts: int = 3
    # The reaper + reconciler loop in the API process (service/reaper.py); 0 turns it off.
    reaper_interval_seconds: float = Field(5.0, ge=0)
    # A `queued` job missing from its broker queue this long is sent again (a wake-up sent
    # moments ago is still in flight to Redis, or just popped by a worker about to claim it).
    reconcile_grace_seconds: float = Field(5.0, ge=0)

    # A job on a catalog model that is not in the model store yet downloads it in the worker;
    # off: such a job is refused at submit (400 naming `model`) until `loraq models pull`.
    auto_pull: bool = True

    worker_queue: str = "default"
    # A worker whose consumer takes no message for this long while messages wait in its queue,
    # it runs no job and Redis answers, restarts itself (worker/consumer_watch.py).
    worker_stuck_seconds: float = Field(60.0, gt=0)
    # `loraq worker --gpus` writes one Prometheus file_sd target per GPU process into this
    # directory (default <data_dir>/prometheus-targets), naming this host as Prometheus reaches
    # it: `worker_metrics_advertise`, else this host's address.
    prometheus_targets_dir: Path | None = None
    worker_metrics_advertise: str | None = None
    # The worker's Prometheus `/metrics` (worker/metrics/server.py): port (0: a free one) and bind address
    # (unset: `host`). `loraq worker --gpus` gives each child the port + its slot.
    worker_metrics_port: int = Field(9108, ge=0, le=65535)
    worker_metrics_host: str | None = None
    # Host GPUs this worker owns ("2" or "2,3"): `loraq worker --gpus` sets it for each child, which
    # then reports only these GPUs' metrics and names its GPU in the job's worker_id.
    worker_gpus: str | None = None
    # A job on several hosts (n_nodes > 1): the address the other hosts reach this worker at for
    # the rendezvous and the ranks' traffic (unset: this host's address, as for the metrics), and
    # how long the worker that claimed such a job waits for the others to join before the attempt
    # ends (it counts as an attempt; the job goes back to the queue while attempts are left).
    worker_rendezvous_address: str | None = None
    node_join_timeout_seconds: float = Field(600.0, gt=0)

    # The GPU kernels' switches; gpu_kernels reads no environment, the worker passes these down.
    # "reference" forces the plain-torch ops even on a GPU (for comparisons).
    kernels: Literal["auto", "reference"] = "auto"
    # How the LoRA term meets the base GEMM's output (gpu_kernels/ops/lora.py says what each does).
    rank_update: Literal["epilogue", "cublas", "kernel"] = "epilogue"
    kernel_cache: Path | None = None  # where compiled kernels are cached; unset: ~/.cache/loraq/kernels

    # Every Redis and broker call is bounded: connect and socket timeouts for each client
    # (rate limiter, reaper, health, dashboard, metrics, worker registry, Celery's broker), a bounded
    # number of publish retries, and a deadline on the whole publish. A publish that misses it
    # leaves the job `queued` in the database (the outbox) and the reconciler sends it later; for
    # `broker_backoff_seconds` after a miss, publishes are not tried at all.
    redis_connect_timeout_seconds: float = Field(1.0, gt=0)
    redis_socket_timeout_seconds: float = Field(1.0, gt=0)
    broker_publish_retries: int = Field(1, ge=0, le=10)
    broker_publish_timeout_seconds: float = Field(2.0, gt=0)
    broker_backoff_seconds: float = Field(5.0, ge=0)

    # Refuse at submit a job whose queue (worker class) no live worker serves, or whose n_gpus no
    # worker offers. True accepts them (autoscaled queues): the job waits, and its
    # status and events say what for.
    accept_unserved_jobs: bool = False
    # An Idempotency-Key is remembered this long (Stripe: 24 h); after that it may be used again.
    idempotency_key_ttl_seconds: int = Field(24 * 3600, ge=1)
    # `/metrics` answers only with `Authorization: Bearer <token>`: this one, else one generated once
    # in <data_dir>/metrics_token (service/api/metrics.py).
    metrics_bearer_token: str | None = None

    # Checkpoints: every `checkpoint_every` steps (0: off), at every epoch end, and at
    # least every `checkpoint_interval_seconds` of training (0: off), so a lost worker loses at most that.
    checkpoint_every: int = 0
    # A job without a validation_file holds out this share of its examples for a validation curve
    # (at most 200, and only from 100 examples on); a job's `validation_split` overrides it; 0: off.
    validation_split: float = Field(0.05, ge=0, le=0.5)

    # Webhooks (service/webhooks.py, service/webhook_delivery.py; README "Webhooks"). Endpoints
    # must be https (http too with `webhook_allow_http`) and may not point at loopback, link-local
    # or unspecified addresses, this machine's own addresses or the API's host, nor at
    # `webhook_deny_networks`, unless listed in `webhook_allow_hosts` (host names, addresses or
    # CIDR networks). Checked at registration and again on each resolved address at delivery.
    webhook_allow_http: bool = False
    webhook_allow_hosts: list[str] = Field(default_factory=list)
    webhook_deny_networks: list[IPvAnyNetwork] = Field(default_factory=list)
    webhook_max_endpoints_per_tenant: int = Field(10, ge=1)
    # An operator-wide endpoint that receives every tenant's job events (its secret: `whsec_...`).
    webhook_operator_url: str | None = None
    webhook_operator_secret: str | None = None
    # The sender loop in the API process: how often it looks for due deliveries (0: off), how many
    # it sends at once, a request's timeout, the delays between attempts (the last repeats) and how
    # long after the event it stops trying (Standard Webhooks' schedule, cut at a day).
    webhook_interval_seconds: float = Field(1.0, ge=0)
    webhook_concurrency: int = Field(4, ge=1, le=64)
    webhook_timeout_seconds: float = Field(15.0, gt=0)
    webhook_retry_delays_seconds: list[float] = Field(
        default_factory=lambda: [5.0, 300.0, 1800.0, 7200.0, 18000.0, 36000.0], min_length=1
    )
    webhook_retry_window_seconds: float = Field(24 * 3600.0, gt=0)

    checkpoint_each_epoch: bool = True
    checkpoint_interval_seconds: float = Field(600.0, ge=0)
    # A worker's MLflow tracking server (http(s)://..., or a local file:/sqlite: store): jobs with an
    # `mlflow` integration are logged there (service/integrations.py). Unset: this worker logs to
    # no MLflow, and says so in its registry entry. W&B's key is WANDB_API_KEY, wandb's own variable.
    mlflow_tracking_uri: str | None = None
    # A worker claims a job only while the filesystem of its data dir has this much free: a job
    # that ran out of disk goes back to the queue and waits there, instead of failing again. 0: off.
    min_free_disk_bytes: int = Field(1 << 30, ge=0)

    # Where datasets, checkpoints, adapters and results live (service/storage.py, README "Object
    # storage"): unset, the directory <data_dir>/store; `s3://bucket/prefix`, an S3-compatible
    # bucket. Endpoint, region and credentials: these settings, else boto3's own (AWS_ENDPOINT_URL,
    # AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, profiles, instance roles).
    storage_url: str | None = Field(None, pattern=r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/.*)?$")
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    s3_addressing_style: Literal["auto", "path", "virtual"] = "auto"  # path: MinIO and most others
    # An upload is sent in parts of this size (about two in memory per upload); S3 wants >= 5 MiB.
    storage_part_bytes: int = Field(8 << 20, ge=64 << 10)
    # A host's local copies of S3 objects (datasets a worker tokenizes, checkpoints it resumes
    # from) under <data_dir>/cache/store, least recently used evicted past this size.
    storage_cache_bytes: int = Field(20 << 30, ge=0)
    # Downloads of files and adapters from S3: a redirect (307) to a presigned URL valid this
    # long, instead of the bytes through the API.
    storage_presign_downloads: bool = False
    storage_presign_seconds: int = Field(3600, ge=1, le=7 * 24 * 3600)
    # The bucket's address as the API's clients reach it, for those presigned URLs: a URL is
    # signed for one host, and s3_endpoint_url is often one only the hosts of the deployment
    # resolve (http://minio:9000 in docker/two-hosts). Unset: s3_endpoint_url's.
    s3_public_endpoint_url: str | None = None

    @property
    def redis_timeouts(self) -> dict[str, float]:
        """The connect and socket timeouts of every Redis client (service/redis_client.py)."""
        return {
            "socket_timeout": self.redis_socket_timeout_seconds,
            "socket_connect_timeout": self.redis_connect_timeout_seconds,
        }

    # Chat completions (service/inference.py, worker/inference.py): the Redis request list that
    # `loraq inference` workers serve, and what one such worker holds.
    inference_queue: str = Field("inference", pattern=r"^[A-Za-z0-9_-]+$")
    inference_timeout_seconds: float = Field(60.0, gt=0)  # no event from a worker this long: 503
    # a request that finds no worker serving but one starting waits this long for it (then 503)
    inference_start_wait_seconds: float = Field(30.0, ge=0)
    inference_max_batch: int = Field(32, ge=1, le=1024)  # requests decoded together
    inference_max_adapters: int = Field(8, ge=1, le=1024)  # adapter slots per base model (LRU)
    inference_max_models: int = Field(2, ge=1, le=64)  # base models kept loaded (LRU)
    inference_preload: list[str] = Field(default_factory=lambda: ["tiny-llama"])
    # torch threads of a CPU inference worker: decode steps are tiny, and on a busy small machine
    # one thread is faster than several that wait for each other
    inference_cpu_threads: int = Field(1, ge=1, le=256)
    inference_metrics_port: int = Field(9110, ge=0, le=65535)  # 0: a free port

    # The `loraq` CLI's HTTP commands (service/client.py): the API they talk to (`--url` overrides;
    # the key is `api_key` unless `--api-key` is given), and tracebacks instead of one-line errors.
    url: str = "http://127.0.0.1:8000"
    debug: bool = False

    # bench/ and scripts/gpu_check.py only: "0" runs Loraq's train step without CUDA-graph capture,
    # and the commit the results are recorded under (unset: `git rev-parse HEAD`, else "unknown").
    bench_capture: bool = True
    commit: str | None = None

    @property
    def resolved_data_dir(self) -> Path:
        return self.data_dir.expanduser().resolve()

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{self.resolved_data_dir / 'loraq.db'}"

    @property
    def resolved_redis_url(self) -> str:
        """The broker's Redis: every Redis client (service/redis_client.py) and Celery use it."""
        return self.redis_url or DEFAULT_REDIS_URL

    @property
    def model_store(self) -> Path:
        return self.resolved_data_dir / "models"

    @property
    def resolved_prometheus_targets_dir(self) -> Path:
        return self.prometheus_targets_dir or self.resolved_data_dir / "prometheus-targets"

    @property
    def artifact_dir(self) -> Path:
        return self.resolved_data_dir / "store"

    @property
    def storage_cache_dir(self) -> Path:
        return self.resolved_data_dir / "cache" / "store"


@lru_cache
def get_settings() -> Settings:
    return Settings()
