"""`matrix db`: create, upgrade and locate the database."""

from __future__ import annotations

import click

from matrix.cli.app import App, MatrixGroup, pass_app


@click.group(cls=MatrixGroup)
def db() -> None:
    """Create, upgrade and locate the database."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@pass_app
def db_upgrade(app: App, revision: str) -> None:
    """Apply migrations up to REVISION (creates the database if needed)."""
    from matrix.db.engine import display_url
    from matrix.db.migrate import upgrade

    engine = app.engine(check_schema=False)
    before, after = upgrade(engine, revision)
    url = display_url(str(engine.url.render_as_string(hide_password=False)))
    if before == after:
        click.echo(f"{url}: already at {after}")
    else:
        click.echo(f"{url}: upgraded {before or 'empty'} -> {after}")


@db.command("downgrade")
@click.argument("revision")
@pass_app
def db_downgrade(app: App, revision: str) -> None:
    """Revert migrations down to REVISION ("base" removes every table)."""
    from matrix.db.migrate import downgrade

    before, after = downgrade(app.engine(check_schema=False), revision)
    click.echo(f"downgraded {before} -> {after or 'base'}")


@db.command("current")
@pass_app
def db_current(app: App) -> None:
    """Print the schema revision of the database and the one this matrix needs."""
    from matrix.db.migrate import current_revision, head_revision

    engine = app.engine(check_schema=False)
    click.echo(f"database: {current_revision(engine) or 'empty'}\nmatrix needs: {head_revision(engine)}")


@db.command("path")
@pass_app
def db_path(app: App) -> None:
    """Print the database URL in use (password hidden)."""
    from matrix.db.engine import display_url, resolve_url

    click.echo(display_url(resolve_url(app.db_url)))


def register(cli: click.Group) -> None:
    cli.add_command(db)
