"""`loraq train CONFIG.yaml`: one fine-tune on this machine, no API, queue or database.

The config is a YAML file of the training fields a job takes too (`TrainingConfig`) plus where the
run reads and writes (worker/engine/config_file.py; README, "Engine configuration");
`model_store` defaults to the data dir's store (LORAQ_DATA_DIR). A rich progress bar shows the
step, loss, tokens/s and ETA. The first Ctrl-C asks the engine to stop after the current step (it
writes a checkpoint that `resume_from` continues); a second Ctrl-C aborts at once.

torch and the engine are imported inside the command, so `loraq --help` stays fast.
"""

from __future__ import annotations

import signal
import types
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from worker.engine.training_config import MethodType
from worker.engine.types import CheckpointInfo, StepMetrics

console = Console()
err_console = Console(stderr=True)


def _duration(seconds: float) -> str:
    h, rest = divmod(round(seconds), 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class ProgressCallbacks:
    """TrainingCallbacks that drive a rich progress bar; `stop_requested` is set by Ctrl-C."""

    def __init__(self, progress: Progress, task: TaskID) -> None:
        self.progress = progress
        self.task = task
        self.stop_requested = False
        self.last: StepMetrics | None = None

    def on_step(self, metrics: StepMetrics) -> None:
        self.last = metrics
        valid = "" if metrics.valid_loss is None else f"  valid {metrics.valid_loss:.4f}"
        self.progress.update(
            self.task,
            total=metrics.total_steps,
            completed=metrics.step,
            loss=f"{metrics.train_loss:.4f}{valid}",
            tps=f"{metrics.tokens_per_s:,.0f}",
            eta=_duration(metrics.eta_seconds),
        )

    def on_event(
        self, level: Literal["info", "warn", "error"], message: str, data: dict[str, Any] | None = None
    ) -> None:
        style = {"info": "dim", "warn": "yellow", "error": "red"}[level]
        self.progress.console.print(f"[{style}]{message}[/{style}]")

    def on_checkpoint(self, checkpoint: CheckpointInfo) -> None:
        self.progress.console.print(f"[dim]checkpoint step {checkpoint.step}: {checkpoint.path}[/dim]")

    def should_stop(self) -> bool:
        return self.stop_requested


def method_overrides(
    method: MethodType | None, beta: float | None, rpo_alpha: float | None = None
) -> dict[str, Any]:
    """The config's `method` as `--method`/`--beta`/`--rpo-alpha` set it ({} when none is given)."""
    from worker.engine.types import ConfigError

    dpo = {name: value for name, value in (("beta", beta), ("rpo_alpha", rpo_alpha)) if value is not None}
    for name in dpo:
        if method != "dpo":
            flag = "--" + name.replace("_", "-")
            raise ConfigError(name, f"{flag} is DPO's {name}: give it with --method dpo")
    if method is None:
        return {}
    return {"method": {"type": method, **dpo}}


def train_command(
    config: Annotated[
        Path, typer.Argument(help="Training config (YAML): model, train_file, output_dir, ...")
    ],
    method: Annotated[
        MethodType | None,
        typer.Option(
            help="Training method, over the config's `method`: supervised (chat or prompt/completion "
            "lines) or dpo (preference pairs)"
        ),
    ] = None,
    beta: Annotated[
        float | None,
        typer.Option(help="DPO's beta (with --method dpo; else the config's, or auto: 0.1)"),
    ] = None,
    rpo_alpha: Annotated[
        float | None,
        typer.Option(
            help="DPO's weight of the chosen answers' NLL, 0 for DPO alone (with --method dpo; else "
            "the config's, or auto: 1)"
        ),
    ] = None,
) -> None:
    """Fine-tune a LoRA adapter locally from a YAML config (no service needed)."""
    from service.settings import get_settings
    from worker.engine.config_file import load_config_file
    from worker.engine.types import EngineError

    try:
        train_config = load_config_file(
            config,
            default_model_store=get_settings().model_store,
            overrides=method_overrides(method, beta, rpo_alpha),
        )
    except EngineError as e:
        err_console.print(f"[red]error:[/red] {e}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None

    from worker.engine import recipe
    from worker.kernels import configure_kernels

    configure_kernels()
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} tok/s"),
        TimeElapsedColumn(),
        TextColumn("ETA {task.fields[eta]}"),
        console=console,
    )
    task = progress.add_task("train", total=None, loss="-", tps="-", eta="-")
    callbacks = ProgressCallbacks(progress, task)

    def on_sigint(signum: int, frame: types.FrameType | None) -> None:
        if callbacks.stop_requested:
            raise KeyboardInterrupt
        callbacks.stop_requested = True
        progress.console.print("[yellow]Stopping after this step (Ctrl-C again to abort)...[/yellow]")

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        with progress:
            result = recipe.train(train_config, callbacks)
    except EngineError as e:
        err_console.print(f"[red]training failed:[/red] {e}", soft_wrap=True, highlight=False)
        raise typer.Exit(1) from None
    finally:
        signal.signal(signal.SIGINT, previous)

    if result.stopped:
        console.print(
            f"[yellow]Stopped at step {result.steps}.[/yellow] Checkpoint: {result.adapter_dir}\n"
            f"Continue with `resume_from: {result.adapter_dir}` in the config."
        )
        raise typer.Exit(130)
    valid = "" if result.final_valid_loss is None else f", valid loss {result.final_valid_loss:.4f}"
    console.print(
        f"[green]Done:[/green] {result.steps} steps, {result.trained_tokens:,} tokens, "
        f"train loss {result.final_train_loss:.4f}{valid}\nAdapter (PEFT): {result.adapter_dir}"
    )
