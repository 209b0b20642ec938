"""`matrix catalog sync`, the read-only lists (`matrix backends|runtimes|markers|cases|fixes|gates list`) and
`matrix marker add`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from matrix.cli.app import App, MatrixGroup, json_option, pass_app, with_session

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@click.group(cls=MatrixGroup)
def catalog() -> None:
    """Load the catalog from TOML files."""


@catalog.command("sync")
@click.argument("files", nargs=-1, type=click.Path(path_type=Path))
@click.option("--dry-run", is_flag=True, help="Show what would change; write nothing.")
@click.option(
    "--prune", is_flag=True,
    help="Also retire catalog rows from other files (or of unknown file) of every kind FILES define that FILES "
    "do not list: make FILES the whole catalog.",
)  # fmt: skip
@pass_app
def catalog_sync(app: App, files: tuple[Path, ...], dry_run: bool, prune: bool) -> None:
    """Load FILES (default: the seed catalog) into the database, idempotently.

    Entries are added or updated; rows that came from FILES but that they no longer list are retired
    (hidden), never deleted, so results keep their meaning. Rows of other files are left alone unless
    --prune is given. Prints every change.
    """
    from matrix.catalog.load import default_catalog_files, load_catalog
    from matrix.catalog.sync import sync_catalog

    spec = load_catalog(list(files) or default_catalog_files())
    for warning in spec.warnings:
        click.secho(f"warning: {warning}", err=True, fg="yellow")
    from matrix.catalog.secrets import provider_secrets
    from matrix.redact import remember_secrets

    remember_secrets(provider_secrets(runtime.provider for runtime in spec.runtimes))  # hidden in what sync prints
    factory = app.sessions()
    with factory() as session, session.begin():
        report = sync_catalog(session, spec, prune=prune)
        if dry_run:
            session.rollback()
    from matrix.output import echo

    for change in report.changes:
        detail = f" ({change.detail})" if change.detail else ""
        echo(f"{change.action:>8}  {change.kind:<8} {change.name}{detail}")
    if report.relocated:
        # Not a change of the catalog: its files are read from another place (e.g. an editable checkout now).
        where = ", ".join(sorted({c.source_dir for c in spec.cases if c.name in report.relocated}))
        echo(f"note: {len(report.relocated)} case(s) now read their launch files from {where}")
    click.echo(("dry run: " if dry_run else "") + report.summary())


# --- lists -------------------------------------------------------------------------------------------------


def _list_command(group: click.Group, kind: str) -> None:
    @group.command("list")
    @click.option("--all", "include_retired", is_flag=True, help="Include retired rows.")
    @json_option
    @with_session
    def list_cmd(session: Session, include_retired: bool, as_json: bool) -> None:
        from matrix.catalog import queries
        from matrix.output import print_json, print_table

        columns, rows = queries.LISTINGS[kind](session, include_retired=include_retired)
        if as_json:
            print_json([dict(zip(columns, row, strict=True)) for row in rows])
        else:
            print_table(columns, rows)

    list_cmd.__doc__ = f"List {kind}."


@click.group(cls=MatrixGroup)
def marker() -> None:
    """Add a marker by hand."""


@marker.command("add")
@click.argument("name")
@click.option(
    "--kind",
    default="other",
    show_default=True,
    type=click.Choice(["lifecycle", "hardware", "framework", "kind", "other", "resource"]),
)
@click.option("--description", default="")
@click.option("--parametrised", is_flag=True, help="The marker takes a value, e.g. name(2048).")
@with_session
def marker_add(session: Session, name: str, kind: str, description: str, parametrised: bool) -> None:
    """Add marker NAME."""
    from matrix.catalog.edit import add_marker

    add_marker(session, name, kind, description, parametrised)
    click.echo(f"added marker {name} ({kind})")


def register(cli: click.Group) -> None:
    cli.add_command(catalog)
    for kind in ("backends", "runtimes", "markers", "cases", "fixes", "gates"):
        group = MatrixGroup(kind, help=f"Show {kind} of the catalog.")
        cli.add_command(group)
        _list_command(group, kind)
    cli.add_command(marker)
