"""Terminal output: tables for people, JSON for machines."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click


def print_json(data: Any) -> None:
    # JSON writes every control character as an escape (\u001b), so nothing raw reaches the terminal.
    click.echo(json.dumps(data, indent=2, default=str))


def echo(text: str = "", *, err: bool = False) -> None:
    """`click.echo` for text that may carry catalog or process strings: control bytes as visible escapes."""
    from matrix.text import printable

    click.echo(printable(text), err=err)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None) -> None:
    """A rich table on a terminal; plain, wide rows when piped so nothing is cut."""
    # Imported here: Rich costs ~0.1 s of start-up, and most commands print no table.
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from matrix.text import printable

    console = Console(soft_wrap=False)
    table = Table(title=printable(title) if title else None, show_lines=False, header_style="bold")
    for column in columns:
        table.add_column(printable(column), overflow="fold")
    for row in rows:
        # Text, not markup: values are data, and `disagg-matrix[ray]` or `[[case]]` must print as written.
        # Catalog names and notes may hold control bytes: shown as visible escapes, never sent raw.
        table.add_row(*(Text(printable("" if v is None else str(v))) for v in row))
    if not console.is_terminal:
        console = Console(width=max(200, console.width), soft_wrap=False)
    console.print(table)
