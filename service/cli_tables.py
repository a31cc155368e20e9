"""The CLI's tables: one borderless style, and `--wide` for rows as long as their content.

At the terminal's width rich shrinks and ellipsizes the columns that do not fit; `--wide` prints
at `WIDE_COLUMNS` instead (for scripts, and for anyone piping the output)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Column, Table

WIDE_COLUMNS = 10_000  # --wide: rows as long as their content
WideOpt = Annotated[bool, typer.Option("--wide", help="Full ids and every column (past 80 columns).")]


def table(*columns: Column | str, title: str | None = None) -> Table:
    """A borderless table: at 80 columns rich shrinks and ellipsizes the flexible columns."""
    return Table(*columns, title=title, box=box.SIMPLE_HEAD, pad_edge=False, expand=False, show_edge=False)


def print_table(console: Console, table: Table, wide: bool) -> None:
    if wide:
        Console(width=WIDE_COLUMNS).print(table, crop=False)
    else:
        console.print(table)
