"""Terminal output: tables for people, JSON for machines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text


def print_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
    """A rich table on a terminal; plain, wide rows when piped so nothing is cut."""
    console = Console(soft_wrap=False)
    table = Table(title=title, show_lines=False, header_style="bold")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        # Text, not markup: values are data, and `disagg-matrix[ray]` or `[[case]]` must print as written.
        table.add_row(*(Text("" if v is None else str(v)) for v in row))
    if not console.is_terminal:
        console = Console(width=max(200, console.width), soft_wrap=False)
    console.print(table)
