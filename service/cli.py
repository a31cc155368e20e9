"""The `loraq` command (typer + rich).

`up`, `worker` and `keys` run locally (processes, the database); `files` and `jobs` talk HTTP to
the API through `service.client`. Heavy imports (torch, the engine, SQLAlchemy models) happen
inside the commands that need them, so `loraq --help` stays fast.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Column
from rich.text import Text

from service import cli_format as fmt
from service import cli_tables
from service.client import ApiError, ClientError, LoraqClient
from service.job_status import TERMINAL

app = typer.Typer(
    name="loraq",
    help="Loraq: self-hostable LoRA fine-tuning. Errors are one line; --debug shows tracebacks.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
keys_app = typer.Typer(help="API keys (talks to the database directly).", no_args_is_help=True)
files_app = typer.Typer(help="Upload and list dataset files.", no_args_is_help=True)
jobs_app = typer.Typer(help="Fine-tuning jobs.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")
app.add_typer(files_app, name="files")
app.add_typer(jobs_app, name="jobs")

console = Console()
err_console = Console(stderr=True)

DEFAULT_MODEL = "smollm2-135m-instruct"  # real pretrained weights; tiny-llama is random, for tests

# Unset: LORAQ_URL and LORAQ_API_KEY, through the settings (service/client.py).
UrlOpt = Annotated[str | None, typer.Option("--url", help="API base URL (default: LORAQ_URL).")]
KeyOpt = Annotated[str | None, typer.Option("--api-key", help="API key (default: LORAQ_API_KEY).")]
WideOpt = cli_tables.WideOpt

T = TypeVar("T")


class _State:
    debug = False  # --debug; LORAQ_DEBUG is read when an error is reported (`_debug`)


def _debug() -> bool:
    """--debug or LORAQ_DEBUG. Settings that do not load (the error being reported may be theirs)
    count as off."""
    from service.settings import get_settings

    if _State.debug:
        return True
    try:
        return get_settings().debug
    except ValueError:  # pydantic's ValidationError
        return False


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show tracebacks instead of one-line errors (or LORAQ_DEBUG=1).")
    ] = False,
) -> None:
    if debug:
        _State.debug = True


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one line to stderr (never wrapped, so it stays greppable) and exit."""
    err_console.print(Text("error: ", style="red") + Text(message), soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def _client(url: str | None, api_key: str | None) -> LoraqClient:
    return _api_call(LoraqClient, url, api_key)


def _print_json(obj: Any) -> None:
    console.print_json(json.dumps(obj))


def _api_call(fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    """Run one client call. An expected failure is one line, exit 2 when the server cannot be
    reached or no key is set (nothing was asked of the server), 1 when the server said no."""
    try:
        return fn(*args, **kw)
    except ClientError as e:
        if _debug():
            raise
        fail(str(e), 1 if isinstance(e, ApiError) else 2)


def main() -> None:
    """The `loraq` entry point: `app()`, with an unexpected exception as one line unless --debug."""
    try:
        app()
    except Exception as e:
        if _debug():
            raise
        line = f"{type(e).__name__}: {e} (run with --debug for the traceback)"
        err_console.print(Text("error: ", style="red") + Text(line), soft_wrap=True, highlight=False)
        sys.exit(1)


def _short_ids(ids: list[str], wide: bool) -> dict[str, str]:
    return {i: i for i in ids} if wide else fmt.unique_prefixes(ids)


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
def api() -> None:
    """Serve the API (uvicorn on LORAQ_HOST:LORAQ_PORT) with its per-connection limits."""
    from service.api_server import serve
    from service.settings import get_settings

    serve(get_settings())


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
            fail(str(e), 2)
        raise typer.Exit(launcher.run_workers(specs))

    if queue is not None:
        # The worker's registry entry and metrics read the queue from settings: they must name the
        # queue it consumes, or the API refuses jobs for it as unserved (as the launcher does).
        os.environ["LORAQ_WORKER_QUEUE"] = queue
        get_settings.cache_clear()
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
    from worker import consumer_watch

    # 75 (EX_TEMPFAIL) when its consumer stopped taking messages: `loraq up` restarts it, no crash
    raise typer.Exit(consumer_watch.exit_code())


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
        fail(str(e))
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
        fail(str(e))
    console.print(f"revoked {prefix}")


@keys_app.command("list")
def keys_list() -> None:
    """List keys (prefixes only)."""
    from service.auth import list_keys
    from service.db.session import session_scope

    table = cli_tables.table(Column("prefix", no_wrap=True), "tenant", "created", "revoked")
    with session_scope() as session:
        for row in list_keys(session):
            revoked = fmt.ago(row.revoked_at) if row.revoked_at else ""
            table.add_row(row.prefix, row.tenant, fmt.ago(row.created_at), revoked)
    console.print(table)


# --------------------------------------------------------------------------- files


@files_app.command("upload")
def files_upload(
    path: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True)],
    purpose: Annotated[str, typer.Option(help="fine-tune")] = "fine-tune",
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Upload a JSONL dataset; prints the file object (its id is what `jobs create` needs). A file
    that failed validation (`status` error) is stored but no job can use it: exit 1, naming its
    bad lines."""
    with _client(url, api_key) as c:
        file = _api_call(c.upload_file, path, purpose)
    _print_json(file)
    if file.get("status") == "error":
        fail(f"{path}: {file['id']} failed validation: {file.get('status_details')}")


@files_app.command("list")
def files_list(url: UrlOpt = None, api_key: KeyOpt = None, wide: WideOpt = False) -> None:
    """Uploaded files, newest first; ids are shortened to a unique prefix (--wide: in full)."""
    with _client(url, api_key) as c:
        data = _api_call(c.list_files)["data"]
    short = _short_ids([f["id"] for f in data], wide)
    table = cli_tables.table(
        Column("id", no_wrap=True),
        Column("filename", overflow="ellipsis", max_width=None if wide else 28),
        Column("size", justify="right", no_wrap=True),
        Column("status", no_wrap=True),
        Column("purpose", no_wrap=True),
        Column("created", no_wrap=True),
    )
    for f in data:
        created = fmt.ago(f["created_at"])
        table.add_row(
            short[f["id"]], f["filename"], fmt.size(f["bytes"]), f.get("status") or "", f["purpose"], created
        )
    cli_tables.print_table(console, table, wide)


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
    validation_split: float | None = None,
    n_nodes: int | None = None,
    batch_scaling: str | None = None,
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
    if validation_split is not None:
        body["validation_split"] = validation_split
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
    if n_nodes is not None:
        body["n_nodes"] = n_nodes
    if batch_scaling is not None:  # with several GPUs: split batch_size (global) or on each (per_gpu)
        body["batch_scaling"] = batch_scaling
    if packing is not None:  # padding-free packed rows (server default: on)
        body["packing"] = packing
    return body


@jobs_app.command("create")
def jobs_create(
    training_file: Annotated[str, typer.Option(help="File id (file-…) from `files upload`.")],
    model: Annotated[str, typer.Option(help="Base model (`loraq models list`).")] = DEFAULT_MODEL,
    validation_file: Annotated[
        str | None, typer.Option(help="File id; without one a share of the examples is held out.")
    ] = None,
    validation_split: Annotated[
        float | None,
        typer.Option(min=0.0, max=0.5, help="Held-out share with no validation file (0.05; 0: none)."),
    ] = None,
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
    n_nodes: Annotated[
        int | None, typer.Option(min=1, help="Hosts the job spans (> 1: that many workers at once).")
    ] = None,
    packing: Annotated[
        bool | None,
        typer.Option(
            "--packing/--no-packing", help="Pack examples into full rows, padding-free (server default: on)."
        ),
    ] = None,
    batch_scaling: Annotated[
        str | None,
        typer.Option(
            help="With several GPUs: global splits batch_size over them (server default); per_gpu gives "
            "each GPU batch_size rows, fewer steps, learning rate x sqrt(GPUs)."
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
        validation_split=validation_split,
        n_nodes=n_nodes,
        batch_scaling=batch_scaling,
    )
    if dry_run:
        body["dry_run"] = True
    with _client(url, api_key) as c:
        _print_json(_api_call(c.create_job, body))


def find_job_id(c: LoraqClient, given: str) -> str:
    """A full job id, or the one job whose id starts with `given` (the short ids tables show)."""
    if len(given) >= len("ftjob-") + 24:
        return given
    matches: list[str] = []
    after: str | None = None
    while True:  # page through the tenant's jobs, newest first
        page = _api_call(c.list_jobs, 100, after)
        matches += [j["id"] for j in page["data"] if j["id"].startswith(given)]
        if not page.get("has_more") or not page["data"] or len(matches) > 1:
            break
        after = page["data"][-1]["id"]
    if len(matches) == 1:
        return matches[0]
    if matches:
        fail(f"job id {given!r} is ambiguous: {', '.join(matches[:5])}; give more characters")
    fail(f"no fine-tuning job id starts with {given!r} (`loraq jobs list` shows them)")


@jobs_app.command("list")
def jobs_list(
    limit: Annotated[int, typer.Option(min=1, max=100)] = 20,
    after: Annotated[str | None, typer.Option(help="Cursor: the last job id of the previous page.")] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
    wide: WideOpt = False,
) -> None:
    """Jobs, newest first; ids are shortened to a unique prefix that every `jobs` command accepts."""
    with _client(url, api_key) as c:
        page = _api_call(c.list_jobs, limit, after)
    data = page["data"]
    short = _short_ids([j["id"] for j in data], wide)
    columns = [
        Column("id", no_wrap=True),
        Column("model", overflow="ellipsis", max_width=None if wide else 22),
        Column("status", no_wrap=True),
        Column("suffix", overflow="ellipsis", max_width=None if wide else 16),
        Column("created", no_wrap=True),
        Column("duration", justify="right", no_wrap=True),
    ]
    if wide:
        columns += [Column("fine_tuned_model", no_wrap=True), Column("error", no_wrap=True)]
    table = cli_tables.table(*columns)
    for j in data:
        cells = [
            short[j["id"]],
            j["model"],
            j["status"] + _stopping(j),
            j.get("user_provided_suffix") or "",
            fmt.ago(j["created_at"]),
            fmt.job_duration(j),
        ]
        if wide:
            err = j.get("error") or {}
            cells += [j.get("fine_tuned_model") or "", err.get("code") or ""]
        table.add_row(*cells)
    cli_tables.print_table(console, table, wide)
    if page.get("has_more") and data:
        console.print(f"more: --after {data[-1]['id']}", soft_wrap=True)


@jobs_app.command("get")
def jobs_get(
    job_id: Annotated[str, typer.Argument(help="A job id or a unique prefix of one.")],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """The job object as JSON."""
    with _client(url, api_key) as c:
        _print_json(_api_call(c.get_job, find_job_id(c, job_id)))


def _stopping(job: dict[str, Any]) -> str:
    """What follows a running job's status in the list: a stop asked but not reached yet."""
    if job["status"] != "running":
        return ""
    if job.get("cancel_requested"):
        return " (cancelling)"
    return " (pausing)" if job.get("pause_requested") else ""


def cancel_message(job: dict[str, Any], asked: str = "cancel_requested") -> str:
    """What a cancel (or a pause: `asked` "pause_requested") did, in the status the server answered."""
    if job["status"] == "running" and job.get(asked):
        what = "cancel requested" if asked == "cancel_requested" else "pause requested (a checkpoint is kept)"
        return (
            f"{job['id']}: running, {what}: it stops after its current step "
            f"(`loraq jobs watch {job['id']}` shows when)"
        )
    return f"{job['id']}: {job['status']}"


@jobs_app.command("cancel")
def jobs_cancel(
    job_id: Annotated[str, typer.Argument(help="A job id or a unique prefix of one.")],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Cancel a job: a queued one at once, a running one after its current step."""
    with _client(url, api_key) as c:
        job = _api_call(c.cancel_job, find_job_id(c, job_id))
    console.print(cancel_message(job), soft_wrap=True, highlight=False)


@jobs_app.command("pause")
def jobs_pause(
    job_id: Annotated[str, typer.Argument(help="A job id or a unique prefix of one.")],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Pause a job: a queued one at once, a running one after its current step, with a checkpoint
    (its GPU takes the next job); `loraq jobs resume` continues it from there."""
    with _client(url, api_key) as c:
        job = _api_call(c.job_action, find_job_id(c, job_id), "pause")
    console.print(cancel_message(job, "pause_requested"), soft_wrap=True, highlight=False)


@jobs_app.command("resume")
def jobs_resume(
    job_id: Annotated[str, typer.Argument(help="A job id or a unique prefix of one.")],
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Resume a paused job (queued again, it continues from its checkpoint), or withdraw a pause
    its worker has not reached yet."""
    with _client(url, api_key) as c:
        job = _api_call(c.job_action, find_job_id(c, job_id), "resume")
    console.print(f"{job['id']}: {job['status']}", soft_wrap=True, highlight=False)


LEVEL_STYLE = {"info": "", "warn": "yellow", "error": "red"}


def event_line(ev: dict[str, Any]) -> Text:
    """`12:03:04 warn  message` (local time; the date when it is not today)."""
    t = time.localtime(ev["created_at"])
    stamp = time.strftime("%H:%M:%S" if t[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M:%S", t)
    level = ev["level"]
    return Text(f"{stamp} ") + Text(f"{level:<5} ", style=LEVEL_STYLE.get(level, "")) + Text(ev["message"])


@jobs_app.command("events")
def jobs_events(
    job_id: Annotated[str, typer.Argument(help="A job id or a unique prefix of one.")],
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 50,
    steps: Annotated[bool, typer.Option("--steps", help="Also the per-step metrics lines.")] = False,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Events, oldest first: milestones, warnings and errors (--steps: per-step metrics too)."""
    with _client(url, api_key) as c:
        events = _api_call(c.list_events, find_job_id(c, job_id), limit)["data"]
    folded = 0
    for ev in reversed(events):
        if ev.get("type") == "metrics" and not steps:
            folded += 1
            continue
        line = event_line(ev)
        if steps and ev.get("data"):
            line += Text(f"  {json.dumps(ev['data'])}", style="dim")
        console.print(line, soft_wrap=True, highlight=False)
    if folded:
        console.print(f"({folded} per-step lines folded; --steps shows them)", style="dim")


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


def _new_events(c: LoraqClient, job_id: str, seen: set[str]) -> list[dict[str, Any]]:
    """The job's events not handled yet, oldest first (its last 50: a poll a second keeps up)."""
    events = c.list_events(job_id, limit=50)["data"]
    fresh = [e for e in reversed(events) if e["id"] not in seen]
    seen.update(e["id"] for e in events)
    return fresh


@jobs_app.command("watch")
def jobs_watch(
    job_id: Annotated[str, typer.Argument(help="A job id or a unique prefix of one.")],
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between polls.")] = 1.0,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Live progress (step, loss, tokens/s, ETA from the first step on), the job's plan, milestones
    and health warnings until the job ends; exit code 1 unless it succeeded. Not on a terminal
    (a pipe, a log file) each new step is a line of its own."""
    with _client(url, api_key) as c:
        job_id = find_job_id(c, job_id)
        seen: set[str] = set()
        with Progress(
            TextColumn("[bold]{task.fields[status]}"),
            BarColumn(),
            TextColumn("step {task.fields[steps]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("ETA {task.fields[eta]}"),
            console=console,
        ) as progress:
            bar = progress.add_task(job_id, total=None, status="…", steps="-", loss="-", tps="-", eta="-")
            last_step = 0
            while True:
                job = _api_call(c.get_job, job_id)
                for ev in _api_call(_new_events, c, job_id, seen):  # in the order they happened
                    if ev.get("type") != "metrics":  # the plan, milestones, warnings, errors
                        progress.console.print(event_line(ev), soft_wrap=True, highlight=False)
                        continue
                    m = ev.get("data")
                    if not m:
                        continue
                    loss = m.get("train_loss")
                    tps = m.get("tokens_per_s")
                    progress.update(
                        bar,
                        total=m.get("total_steps") or None,
                        completed=m.get("step", 0),
                        steps=f"{m.get('step', 0)}/{m.get('total_steps') or '?'}",
                        loss=f"{loss:.4f}" if isinstance(loss, int | float) else "-",
                        tps=f"{tps:.0f}" if isinstance(tps, int | float) else "-",
                        eta=fmt.duration(m.get("eta_seconds")),
                    )
                    if not console.is_terminal and m.get("step", 0) > last_step:  # no live bar: a line each
                        last_step = m["step"]
                        fields = progress.tasks[0].fields
                        progress.console.print(
                            f"step {fields['steps']}  loss {fields['loss']}  {fields['tps']} tok/s  "
                            f"ETA {fields['eta']}",
                            highlight=False,
                        )
                progress.update(bar, status=job["status"])
                if job["status"] in TERMINAL:
                    break
                time.sleep(interval)
    took = fmt.job_duration(job)
    if job["status"] == "succeeded":
        console.print(f"[green]succeeded[/green] in {took}: {job.get('fine_tuned_model')}", soft_wrap=True)
        return
    error = job.get("error") or {}
    line = Text(job["status"], style="red")
    if error.get("code"):
        line += Text(f" ({error['code']})")
    if error.get("message"):
        line += Text(f": {error['message']}")
    console.print(line, soft_wrap=True, highlight=False)
    raise typer.Exit(1)


@jobs_app.command("download")
def jobs_download(
    job_id: Annotated[str, typer.Argument(help="A job id or a unique prefix of one.")],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Zip path (default <job>-adapter.zip).")
    ] = None,
    url: UrlOpt = None,
    api_key: KeyOpt = None,
) -> None:
    """Download the job's PEFT adapter as a zip, with a progress bar."""
    with _client(url, api_key) as c:
        job_id = find_job_id(c, job_id)
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
    console.print(f"wrote {dest} ({fmt.size(size)})", soft_wrap=True)


# --------------------------------------------------------------------------- other helpers' commands


# Sub-commands owned by other modules, mounted when present. Those modules import the engine
# (torch) inside their command bodies, so mounting them keeps `loraq --help` fast.
if importlib.util.find_spec("service.cli_train") is not None:
    from service.cli_train import train_command

    app.command("train", help="Run one training job locally from a YAML config.")(train_command)

if importlib.util.find_spec("service.cli_models") is not None:
    from service.cli_models import models_app

    app.add_typer(models_app, name="models", help="Base models: list, pull, add, path.")

if importlib.util.find_spec("service.cli_export") is not None:
    from service.cli_export import export_app

    app.add_typer(export_app, name="export", help="Export adapters: merged into the base model.")


if __name__ == "__main__":
    main()
