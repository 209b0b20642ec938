"""The `matrix` group and what its commands share: the per-invocation `App`, errors -> exit 2, the
selection and `--json` options, and the one-transaction `with_session` decorator.

The commands live in sibling modules (one per command group), each importing this one; this module imports
none of them (`matrix.cli` assembles the group). Thin: parse options, call one function, print the result.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import click

from matrix import __version__
from matrix.errors import MatrixError

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.orm import Session, sessionmaker

    from matrix.plan import Selection

F = TypeVar("F", bound=Callable[..., Any])

_gc_paused = False


def pause_gc() -> None:
    """Pause the cyclic GC for the start-up (see `matrix.cli.main`); `resume_gc` ends the pause."""
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True


def resume_gc() -> None:
    """End a pause of `pause_gc`: what the start-up made is frozen (never walked again), then the GC runs."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def remember_catalog_secrets(factory: sessionmaker[Session]) -> None:
    """Hand the catalog's secret provider values to the redaction (`matrix.catalog.secrets`)."""
    from matrix.catalog.secrets import catalog_secrets
    from matrix.redact import remember_secrets

    with factory() as session:
        remember_secrets(catalog_secrets(session))


@dataclass
class App:
    """Per-invocation state: the database is opened lazily so `--help` never touches it."""

    db_url: str | None
    _engine: Engine | None = None
    _secrets_read: bool = False

    def engine(self, *, check_schema: bool = True) -> Engine:
        from matrix.db.engine import create_db_engine, resolve_url
        from matrix.db.migrate import ensure_schema

        if self._engine is None:
            self._engine = create_db_engine(resolve_url(self.db_url))
            resume_gc()  # the heavy imports are done: from here a long command makes garbage as it runs
        if check_schema:
            ensure_schema(self._engine)
        return self._engine

    def sessions(self) -> sessionmaker[Session]:
        from matrix.db.engine import session_factory

        factory = session_factory(self.engine())
        if not self._secrets_read:
            # Before the command reads or runs anything: the catalog's own secret values are hidden by
            # value at every exit from here on (a process may print one bare).
            self._secrets_read = True
            remember_catalog_secrets(factory)
        return factory

    def close(self) -> None:
        """Close the database's connections now (SQLite checkpoints its WAL then), not whenever the GC
        gets to the engine, which at exit it no longer does (`matrix.cli.main`)."""
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None


class MatrixGroup(click.Group):
    """Turns a `MatrixError` into its message on stderr and exit code 2, without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MatrixError as exc:
            from matrix.text import clean

            click.secho(f"error: {clean(str(exc))}", err=True, fg="red")
            ctx.exit(exc.exit_code)
        except Exception as exc:
            from sqlalchemy.exc import SQLAlchemyError  # imported here: `--help` never loads SQLAlchemy

            if not isinstance(exc, SQLAlchemyError):
                raise
            # A write the database refused as read-only is the user's to fix; anything else is a bug.
            error = _read_only(ctx, exc)
            if error is None:
                raise
            click.secho(f"error: {error}", err=True, fg="red")
            ctx.exit(error.exit_code)


def _read_only(ctx: click.Context, exc: SQLAlchemyError) -> MatrixError | None:
    from matrix.db.engine import read_only_error, resolve_url

    app = ctx.find_object(App)
    return read_only_error(exc, resolve_url(app.db_url if app else None))


pass_app = click.make_pass_decorator(App)


@click.group(cls=MatrixGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--db",
    "db_url",
    envvar="MATRIX_DB",
    metavar="URL",
    help="Database: a SQLAlchemy URL or a SQLite file path. Default: $MATRIX_DB, else matrix.db in the "
    "data directory (`matrix db path`).",
)
@click.version_option(__version__, prog_name="matrix")
@click.pass_context
def cli(ctx: click.Context, db_url: str | None) -> None:
    """Test-matrix runner for disaggregated LLM serving.

    \b
    Typical use:
      matrix catalog sync                 load the seed catalog (data/*.toml)
      matrix plan -m "pre_merge and sidecar and gpu_1"
      matrix run --backend reference      launch real pairs, validate, record
      matrix show CELL                    one outcome with its logs
    """
    ctx.obj = App(db_url)
    ctx.call_on_close(ctx.obj.close)


# --- selection options shared by plan, run, report and export ---------------------------------------------------------


def selection_options(func: F) -> F:
    options = [
        click.option("-m", "marker_expression", metavar="EXPR", help='Marker expression, e.g. "pre_merge and gpu_1".'),
        click.option("--since", multiple=True, metavar="V|BACKEND=V", help="Oldest version (inclusive); repeatable."),
        click.option("--until", multiple=True, metavar="V|BACKEND=V", help="Newest version (inclusive); repeatable."),
        click.option("--backend", "backends", multiple=True, metavar="NAME", help="Only these backends."),
        click.option("--case", "cases", multiple=True, metavar="NAME", help="Only these cases."),
        click.option("--runtime", "runtimes", multiple=True, metavar="BACKEND=V", help="Only these runtimes."),
        click.option(
            "--strict-markers/--no-strict-markers", default=True, show_default=True,
            help="Unknown marker names in -m are an error.",
        ),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def make_selection(**kw: Any) -> Selection:
    from matrix.plan import Selection

    return Selection(
        marker_expression=kw["marker_expression"],
        since=tuple(kw["since"]),
        until=tuple(kw["until"]),
        backends=tuple(kw["backends"]),
        cases=tuple(kw["cases"]),
        runtimes=tuple(kw["runtimes"]),
        strict_markers=kw["strict_markers"],
        skew=kw.get("skew", False),
        skew_frontend=kw.get("skew_frontend", False),
        prefill_runtime=kw.get("prefill_runtime"),
        decode_runtime=kw.get("decode_runtime"),
    )


def skew_options(func: F) -> F:
    """--skew, --skew-frontend, --prefill-runtime, --decode-runtime (`matrix.skew`)."""
    options = [
        click.option("--skew", is_flag=True, help="Every ordered prefill x decode pair of the selected runtimes."),
        click.option("--skew-frontend", is_flag=True, help="With --skew: a Dynamo arm's frontend varies too."),
        click.option("--prefill-runtime", metavar="BACKEND=V", help="One pair: prefill's runtime."),
        click.option("--decode-runtime", metavar="BACKEND=V", help="One pair: decode's runtime."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def json_option(func: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(func)


def with_session(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run the command body in one transaction: everything is written, or nothing."""

    @functools.wraps(func)
    def wrapper(app: App, *args: Any, **kwargs: Any) -> Any:
        from matrix.db.engine import transaction

        with transaction(app.sessions()) as session:
            return func(session, *args, **kwargs)

    return pass_app(wrapper)
