"""`loraq export merged ADAPTER -o OUT`: the base model with an adapter merged into its weights.

ADAPTER is a PEFT adapter directory (a run's `output_dir/adapter`, a checkpoint) or the zip that
`loraq jobs download` / `GET /v1/fine_tuning/jobs/{id}/adapter` gives. The base model is the one
named in its adapter_config.json (`--model` overrides it, for a model registered under another
name). OUT becomes a plain Hugging Face directory (safetensors, config, tokenizer) that
`AutoModelForCausalLM.from_pretrained` loads without PEFT.

torch and the engine are imported inside the command, so `loraq --help` stays fast.
"""

from __future__ import annotations

import tempfile
import zipfile
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from service.settings import get_settings

export_app = typer.Typer(help="Export adapters in other forms.", no_args_is_help=True)
console = Console()
err_console = Console(stderr=True)


def _unpack_zip(archive: Path, into: Path) -> Path:
    """Extract an adapter zip's two files (and nothing else: member names are never trusted)."""
    from worker.engine.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS

    try:
        with zipfile.ZipFile(archive) as zf:
            names = set(zf.namelist())
            for member in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                if member not in names:
                    raise typer.BadParameter(f"{archive} holds no {member}", param_hint="ADAPTER")
                (into / member).write_bytes(zf.read(member))
    except zipfile.BadZipFile as exc:
        raise typer.BadParameter(f"{archive} is not a zip file: {exc}", param_hint="ADAPTER") from exc
    return into


@export_app.command("merged")
def merged_command(
    adapter: Annotated[Path, typer.Argument(help="adapter directory or adapter zip", exists=True)],
    out: Annotated[Path, typer.Option("--out", "-o", help="directory to write the merged model to")],
    model: Annotated[str | None, typer.Option(help="base model name (default: the adapter's)")] = None,
) -> None:
    from worker.engine.export import export_merged, read_adapter_config
    from worker.engine.models import load_base_model
    from worker.engine.types import ModelError

    with tempfile.TemporaryDirectory(prefix="loraq-export-") as tmp:
        adapter_dir = _unpack_zip(adapter, Path(tmp)) if adapter.is_file() else adapter
        try:
            _, base_name = read_adapter_config(adapter_dir)
            name = model or base_name
            if not name:
                raise ModelError("the adapter names no base model: pass --model")
            with console.status(f"loading {name}"):
                base = load_base_model(name, store=get_settings().model_store)
            with console.status(f"merging into {out}"):
                export_merged(adapter_dir, base, out)
        except ModelError as exc:
            err_console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
            raise typer.Exit(1) from exc
    console.print(f"merged {name} + adapter -> {out}")
