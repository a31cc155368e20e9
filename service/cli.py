"""The `loraq` command (typer + rich).

`up`, `worker` and `keys` run locally (processes, the database); `files` and `jobs` talk HTTP to
the API through `service.client`. Heavy imports (torch, the engine, SQLAlchemy models) happen
inside the commands that need them, so `loraq --help` stays fast.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Column, Table

from service.client import ApiError, LoraqClient

app = typer.Typer(name="loraq", help="Loraq: self-hostable LoRA fine-tuning.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys (talks to the database directly).", no_args_is_help=True)
files_app = typer.Typer(help="Upload and list dataset files.", no_args_is_help=True)
jobs_app = typer.Typer(help="Fine-tuning jobs.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(files_app, name="files")
app.add_typer(jobs_app, name="jobs")

console = Console()
err_console = Console(stderr=True)

TERMINAL = {"succeeded", "failed", "cancelled"}

UrlOpt = Annotated[str | None, typer.Option("--url", envvar="LORAQ_URL", help="API base URL.")]
KeyOpt = Annotated[str | None, typer.Option("--api-key", envvar="LORAQ_API_KEY", help="API key.")]


def _client(url: str | None, api_key: str | None) -> LoraqClient:
    try:
        return LoraqClient(url, api_key)
    except ApiError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None


def _print_json(obj: Any) -> None:
    console.print_json(json.dumps(obj))


def _api_call(fn: Any, *args: Any, **kw: Any) -> Any:
    """Run one client call; print an API error cleanly and exit 1 instead of a traceback."""
    try:
        return fn(*args, **kw)
    except ApiError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None


# --------------------------------------------------------------------------- local processes


@app.command()
def up() -> None:
    """Start Redis (unless LORAQ_REDIS_URL is set), the API and one worker; Ctrl-C stops all."""
    from service.settings import get_settings
    from service.up import run_up

    def echo(line: str) -> None:  # no wrapping: keys and URLs must stay copyable on one line
        console.print(line, soft_wrap=True, highlight=False, markup=False)

    raise typer.Exit(run_up(get_settings(), echo=echo))


@app.command()
def worker(
    queue: Annotated[str | None, typer.Option(help="Queue to consume (default LORAQ_WORKER_QUEUE).")] = None,
    concurrency: Annotated[int, typer.Option(min=1, max=1, help="Jobs at once: one per GPU.")] = 1,
    loglevel: Annotated[str, typer.Option(help="Celery log level.")] = "INFO",
    hostname: Annotated[str | None, typer.Option(help="Celery node name.")] = None,
    gpus: Annotated[
        str | None, typer.Option(help="'all' or 0,1,2,3: one worker process per GPU (worker/launcher.py).")
    ] = None,
    gpus_per_job: Annotated[
        int, typer.Option(min=1, help="With --gpus: GPUs per process, for jobs with n_gpus > 1.")
    ] = 1,
) -> None:
    """Start one Celery worker (solo pool: the job runs in this process, next to its cached model)."""
    from service.settings import get_settings

    if gpus is not None:  # deployment issue: a launcher of one pinned `loraq worker` per GPU
        from worker import launcher

        try:
            specs = launcher.child_specs(
                launcher.parse_gpus(gpus),
                queue=queue or get_settings().worker_queue,
                per_job=gpus_per_job,
                loglevel=loglevel,
            )
        except launcher.LaunchError as e:
            err_console.print(f"[red]{e}[/red]")
            raise typer.Exit(2) from None
        raise typer.Exit(launcher.run_workers(specs))

    from worker.celery_app import celery_app

    argv = [
        "worker",
        "--pool=solo",
        f"--concurrency={concurrency}",
        f"--queues={queue or get_settings().worker_queue}",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
    ]
    if hostname:
        argv.append(f"--hostname={hostname}")
    celery_app.worker_main(argv)


@app.command()
def inference(
    queue: Annotated[
        str | None, typer.Option(help="Inference queue to serve (default LORAQ_INFERENCE_QUEUE).")
    ] = None,
) -> None:
    """Serve chat completions (POST /v1/chat/completions): base models stay loaded, adapters in an LRU."""
    from service.settings import get_settings
    from worker.inference import run_inference_worker

    settings = get_settings()
    if queue is not None:
        settings = settings.model_copy(update={"inference_queue": queue})
    raise typer.Exit(run_inference_worker(settings))


# --------------------------------------------------------------------------- keys


@keys_app.command("create")
def keys_create(tenant: Annotated[str, typer.Option(help="Tenant name (created if new).")]) -> None:
    """Create an API key; the plaintext is printed once and never stored."""
    from service.auth import create_key
    from service.db.session import session_scope
    from service.errors import LoraqError

    try:
        with session_scope() as session:
            key = create_key(session, tenant)
    except LoraqError as e:  # e.g. an empty or over-long tenant name
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    console.print(key)


@keys_app.command("revoke")
def keys_revoke(
    prefix: Annotated[str, typer.Argument(help="The key's prefix as `keys list` shows it.")],
) -> None:
    """Revoke a key by its prefix."""
    from service.auth import revoke_key
    from service.db.session import session_scope
    from service.errors import LoraqError

    try:
        with session_scope() as session:
            revoke_key(session, prefix)
    except LoraqError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(1) from None
    console.print(f"revoked {prefix}")


@keys_app.command("list")
def keys_list() -> None:
    """List keys (prefixes only)."""
    from service.auth import list_keys
    from service.db.session import session_scope

    table = Table(Column("prefix", no_wrap=True), "tenant", "created", "revoked")
    with session_scope() as session:
        for row in list_keys(session):
            fields = ("prefix", "tenant", "created_at", "revoked_at")
            table.add_row(*(str(getattr(row, f, "") or "") for f in fields))
    console.print(table)


# --------------------------------------------------------------------------- files


@files_app.command("upload")
def files_upload(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    purpose: Annotated[str, typer.Option(help="fine-tune")] = "fine-tune",
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Upload a JSONL dataset; prints the file object (its id is what `jobs create` needs)."""
    with _client(url, api_key) as c:
        _print_json(_api_call(c.upload_file, path, purpose))


@files_app.command("list")
def files_list(url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    with _client(url, api_key) as c:
        data = _api_call(c.list_files)["data"]
    table = Table(Column("id", no_wrap=True), "filename", "bytes", "purpose", "created_at")
    for f in data:
        table.add_row(f["id"], f["filename"], str(f["bytes"]), f["purpose"], str(f["created_at"]))
    console.print(table)


# --------------------------------------------------------------------------- jobs


def job_body(
    *,
    model: str,
    training_file: str,
    validation_file: str | None,
    n_epochs: int | None,
    batch_size: int | None,
    learning_rate_multiplier: float | None,
    suffix: str | None,
    seed: int | None,
    lora_r: int | None,
    lora_alpha: float | None,
    max_seq_len: int | None,
    queue: str | None = None,
    n_gpus: int | None = None,
    packing: bool | None = None,
) -> dict[str, Any]:
    """The POST /v1/fine_tuning/jobs body; unset options are left out so the server's "auto" applies."""
    hp = {
        k: v
        for k, v in {
            "n_epochs": n_epochs,
            "batch_size": batch_size,
            "learning_rate_multiplier": learning_rate_multiplier,
        }.items()
        if v is not None
    }
    body: dict[str, Any] = {"model": model, "training_file": training_file}
    if validation_file:
        body["validation_file"] = validation_file
    if hp:
        body["hyperparameters"] = hp
    if suffix:
        body["suffix"] = suffix
    if seed is not None:
        body["seed"] = seed
    lora = {k: v for k, v in {"r": lora_r, "alpha": lora_alpha}.items() if v is not None}
    if lora:
        body["lora"] = lora
    if max_seq_len is not None:
        body["max_seq_len"] = max_seq_len
    if queue:  # routing extensions (deployment): worker class and GPUs on one host
        body["queue"] = queue
    if n_gpus is not None:
        body["n_gpus"] = n_gpus
    if packing is not None:  # padding-free packed rows (server default: on)
        body["packing"] = packing
    return body


@jobs_app.command("create")
def jobs_create(
    model: Annotated[str, typer.Option(help="Base model name, e.g. smollm2-135m-instruct.")],
    training_file: Annotated[str, typer.Option(help="File id (file-…) from `files upload`.")],
    validation_file: Annotated[str | None, typer.Option()] = None,
    n_epochs: Annotated[int | None, typer.Option(min=1)] = None,
    batch_size: Annotated[int | None, typer.Option(min=1)] = None,
    learning_rate_multiplier: Annotated[float | None, typer.Option(min=0.0)] = None,
    suffix: Annotated[str | None, typer.Option()] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    lora_r: Annotated[int | None, typer.Option(min=1)] = None,
    lora_alpha: Annotated[float | None, typer.Option(min=0.0)] = None,
    max_seq_len: Annotated[int | None, typer.Option(min=8)] = None,
    queue: Annotated[str | None, typer.Option(help="Worker class (queue), e.g. h100, cpu.")] = None,
    n_gpus: Annotated[int | None, typer.Option(min=1, help="GPUs on one host (> 1: torchrun).")] = None,
    packing: Annotated[
        bool | None,
        typer.Option(
            "--packing/--no-packing", help="Pack examples into full rows, padding-free (server default: on)."
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Validate and plan (steps, tokens, estimates); queue nothing.")
    ] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Create a fine-tuning job; prints the job object (with --dry-run: the plan)."""
    body = job_body(
        model=model,
        training_file=training_file,
        validation_file=validation_file,
        n_epochs=n_epochs,
        batch_size=batch_size,
        learning_rate_multiplier=learning_rate_multiplier,
        suffix=suffix,
        seed=seed,
        lora_r=lora_r,
        lora_alpha=lora_alpha,
        max_seq_len=max_seq_len,
        queue=queue,
        n_gpus=n_gpus,
        packing=packing,
    )
    if dry_run:
        body["dry_run"] = True
    with _client(url, api_key) as c:
        _print_json(_api_call(c.create_job, body))


@jobs_app.command("list")
def jobs_list(
    limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
    after: Annotated[str | None, typer.Option(help="Cursor: the last job id of the previous page.")] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    with _client(url, api_key) as c:
        page = _api_call(c.list_jobs, limit, after)
    table = Table(Column("id", no_wrap=True), "model", "status", "fine_tuned_model", "created_at")
    for j in page["data"]:
        table.add_row(j["id"], j["model"], j["status"], j.get("fine_tuned_model") or "", str(j["created_at"]))
    console.print(table)
    if page.get("has_more") and page["data"]:
        console.print(f"more: --after {page['data'][-1]['id']}")


@jobs_app.command("get")
def jobs_get(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    with _client(url, api_key) as c:
        _print_json(_api_call(c.get_job, job_id))


@jobs_app.command("cancel")
def jobs_cancel(job_id: str, url: UrlOpt = None, api_key: KeyOpt = None) -> None:
    with _client(url, api_key) as c:
        job = _api_call(c.cancel_job, job_id)
    console.print(f"{job['id']}: {job['status']}")


@jobs_app.command("events")
def jobs_events(
    job_id: str,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Events, newest first (messages and per-step metrics)."""
    with _client(url, api_key) as c:
        events = _api_call(c.list_events, job_id, limit)["data"]
    for ev in events:
        data = f"  {json.dumps(ev['data'])}" if ev.get("data") else ""
        console.print(f"{ev['created_at']} [{ev['level']}] {ev['message']}{data}")


@jobs_app.command("internal-errors")
def jobs_internal_errors(job_id: str) -> None:
    """Operator only (reads the database, like `keys`): a job's worker tracebacks, which the API
    never shows to tenants."""
    from service import jobs
    from service.db.session import session_scope

    with session_scope() as session:
        events = jobs.operator_events(session, job_id=job_id)
        lines = [(e.created_at, e.message, (e.data or {}).get("traceback", "")) for e in events]
    if not lines:
        console.print(f"no internal errors recorded for {job_id}")
    for created_at, message, trace in lines:
        console.print(f"{created_at} {message}\n{trace}", markup=False, highlight=False)


def _latest_metrics(c: LoraqClient, job_id: str) -> dict[str, Any] | None:
    """The newest `type: metrics` event's data, looking at the last few events only."""
    for ev in c.list_events(job_id, limit=10)["data"]:
        if ev.get("type") == "metrics" and ev.get("data"):
            data: dict[str, Any] = ev["data"]
            return data
    return None


def _fmt_eta(seconds: Any) -> str:
    if not isinstance(seconds, int | float):
        return "-"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@jobs_app.command("watch")
def jobs_watch(
    job_id: str,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between polls.")] = 1.0,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Live progress (step, loss, tokens/s, ETA) until the job ends; exit code 1 unless it succeeded."""
    with (
        _client(url, api_key) as c,
        Progress(
            TextColumn("[bold]{task.fields[status]}"),
            BarColumn(),
            TextColumn("step {task.fields[steps]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA {task.fields[eta]}"),
            console=console,
        ) as progress,
    ):
        bar = progress.add_task(job_id, total=None, status="…", steps="-", loss="-", tps="-", eta="-")
        while True:
            job = _api_call(c.get_job, job_id)
            m = _api_call(_latest_metrics, c, job_id)
            if m:
                loss = m.get("train_loss")
                progress.update(
                    bar,
                    total=m.get("total_steps") or None,
                    completed=m.get("step", 0),
                    steps=f"{m.get('step', 0)}/{m.get('total_steps') or '?'}",
                    loss=f"{loss:.4f}" if isinstance(loss, int | float) else "-",
                    tps=f"{m['tokens_per_s']:.0f}" if isinstance(m.get("tokens_per_s"), int | float) else "-",
                    eta=_fmt_eta(m.get("eta_seconds")),
                )
            progress.update(bar, status=job["status"])
            if job["status"] in TERMINAL:
                break
            time.sleep(interval)
    if job["status"] == "succeeded":
        console.print(f"[green]succeeded[/green]: {job.get('fine_tuned_model')}")
        return
    error = job.get("error") or {}
    console.print(f"[red]{job['status']}[/red] {error.get('code') or ''}: {error.get('message') or ''}")
    raise typer.Exit(1)


@jobs_app.command("download")
def jobs_download(
    job_id: str,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Zip path (default <job>-adapter.zip).")
    ] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Download the job's PEFT adapter as a zip, with a progress bar."""
    dest = output or Path(f"{job_id}-adapter.zip")
    with (
        _client(url, api_key) as c,
        Progress(
            TextColumn(dest.name), BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=console
        ) as progress,
    ):
        bar = progress.add_task("download", total=None)

        def on_progress(done: int, total: int | None) -> None:
            progress.update(bar, completed=done, total=total)

        size = _api_call(c.download_adapter, job_id, dest, on_progress)
    console.print(f"wrote {dest} ({size} bytes)")


# --------------------------------------------------------------------------- other helpers' commands


# Sub-commands owned by other modules, mounted when present. Those modules import the engine
# (torch) inside their command bodies, so mounting them keeps `loraq --help` fast.
if importlib.util.find_spec("service.cli_train") is not None:
    from service.cli_train import train_command

    app.command("train", help="Run one training job locally from a YAML config.")(train_command)

if importlib.util.find_spec("service.cli_models") is not None:
    from service.cli_models import models_app

    app.add_typer(models_app, name="models", help="Base models: list, pull, add.")

if importlib.util.find_spec("service.cli_export") is not None:
    from service.cli_export import export_app

    app.add_typer(export_app, name="export", help="Export adapters: merged into the base model.")


if __name__ == "__main__":
    app()
