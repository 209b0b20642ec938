"""The `matrix` command line. Thin: parse options, call one function, print the result."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from matrix import __version__
from matrix.errors import MatrixError

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class App:
    """Per-invocation state: the database is opened lazily so `--help` never touches it."""

    db_url: str | None
    _engine: Engine | None = None

    def engine(self, *, check_schema: bool = True) -> Engine:
        from matrix.db.engine import create_db_engine, resolve_url
        from matrix.db.migrate import ensure_schema

        if self._engine is None:
            self._engine = create_db_engine(resolve_url(self.db_url))
        if check_schema:
            ensure_schema(self._engine)
        return self._engine

    def sessions(self) -> sessionmaker[Session]:
        from matrix.db.engine import session_factory

        return session_factory(self.engine())


class MatrixGroup(click.Group):
    """Turns a `MatrixError` into its message on stderr and exit code 2, without a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MatrixError as exc:
            from matrix.report.text import clean

            click.secho(f"error: {clean(str(exc))}", err=True, fg="red")
            ctx.exit(exc.exit_code)
        except SQLAlchemyError as exc:
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


def main() -> None:
    cli(prog_name="matrix")


# --- selection options shared by plan and run ---------------------------------------------------------


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


def make_selection(**kw: Any) -> Any:
    from matrix.plan import Selection

    return Selection(
        marker_expression=kw["marker_expression"],
        since=tuple(kw["since"]),
        until=tuple(kw["until"]),
        backends=tuple(kw["backends"]),
        cases=tuple(kw["cases"]),
        runtimes=tuple(kw["runtimes"]),
        strict_markers=kw["strict_markers"],
    )


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


# --- db ----------------------------------------------------------------------------------------------------


@cli.group(cls=MatrixGroup)
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


# --- catalog -----------------------------------------------------------------------------------------------


@cli.group(cls=MatrixGroup)
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


for _kind in ("backends", "runtimes", "markers", "cases", "fixes", "gates"):
    _group = MatrixGroup(_kind, help=f"Show {_kind} of the catalog.")
    cli.add_command(_group)
    _list_command(_group, _kind)


@cli.group(cls=MatrixGroup)
def runtime() -> None:
    """Add, enable or disable runtime versions; provision, list and prune their environments."""


@runtime.command("add")
@click.argument("backend")
@click.argument("version")
@click.option("--tag", help="Release tag (default: v + VERSION).")
@click.option("--channel", type=click.Choice(["release", "rc", "dev", "nightly"]), help="Default from VERSION.")
@click.option("--component", "components", multiple=True, metavar="NAME=VERSION", help="Repeatable.")
@click.option("--provider", default="host", show_default=True, type=click.Choice(["host", "builtin", "venv"]))
@click.option("--pip", multiple=True, metavar="ARGS",
              help="venv: one `pip install ARGS` step, e.g. --pip 'ai-dynamo==1.6.1'. Repeatable, in order.")
@click.option("--python", metavar="VERSION", help="venv: the interpreter, e.g. 3.11 (default: matrix's own).")
@click.option("--notes", default="")
@with_session
def runtime_add(session: Session, **kw: Any) -> None:
    """Add runtime VERSION of BACKEND, e.g. `matrix runtime add vllm 0.30.0 --component vllm-rs=0.30.0`.

    \b
    A venv runtime, built by `matrix runtime provision` or `matrix run`:
      matrix runtime add dynamo 1.7.0 --provider venv --pip 'ai-dynamo==1.7.0' --component ai-dynamo=1.7.0
    """
    from matrix.catalog.edit import add_runtime

    row = add_runtime(session, **kw)
    click.echo(f"added runtime {row.backend.name} {row.version} ({row.tag}, {row.channel})")


def _set_enabled(enabled: bool) -> Callable[..., None]:
    @click.argument("backend")
    @click.argument("version")
    @with_session
    def command(session: Session, backend: str, version: str) -> None:
        from matrix.catalog.edit import set_runtime_enabled

        row = set_runtime_enabled(session, backend, version, enabled)
        click.echo(f"{'enabled' if enabled else 'disabled'} runtime {row.backend.name} {row.version}")

    return command


runtime.command("disable", help="Disable a runtime: plans exclude it (with the reason).")(_set_enabled(False))
runtime.command("enable", help="Enable a disabled runtime again.")(_set_enabled(True))


@cli.group(cls=MatrixGroup)
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


# --- plan, run, show ---------------------------------------------------------------------------------------


@cli.command("plan")
@selection_options
@click.option("--explain", is_flag=True, help="Also list every excluded combination with its reason.")
@json_option
@click.option(
    "--format", "output_format", type=click.Choice(["table", "json", "github-matrix"]),
    help="github-matrix: one line of JSON for a GitHub Actions `strategy.matrix` (`fromJSON`), a job per shard.",
)  # fmt: skip
@click.option(
    "--max-jobs", type=int, metavar="N",
    help="github-matrix: at most N shards (1-256, default 256); more cells are packed by expected duration.",
)  # fmt: skip
@with_session
def plan_cmd(
    session: Session, explain: bool, as_json: bool, output_format: str | None, max_jobs: int | None, **kw: Any
) -> None:
    """Expand cases x runtimes into cells and print them.

    `matrix plan -m "pre_merge and sidecar and gpu_1"` answers which cases a CI expression collects.
    Cells whose runtime lacks a required fix are kept and annotated: they are expected to fail.
    `--format github-matrix` prints the shards for a CI fan-out (see docs/scale-out.md).
    """
    from matrix.fanout import cell_id
    from matrix.output import print_json, print_table
    from matrix.plan import plan_from_db

    if as_json and output_format not in (None, "json"):
        raise click.UsageError("--json is --format json; give one of them")
    output_format = output_format or ("json" if as_json else "table")
    if max_jobs is not None and output_format != "github-matrix":
        raise click.UsageError("--max-jobs applies to --format github-matrix")
    if explain and output_format == "github-matrix":
        raise click.UsageError("--explain applies to --format table or json")
    plan = plan_from_db(session, make_selection(**kw))
    if output_format == "github-matrix":
        from matrix.cli_fanout import print_github_matrix

        print_github_matrix(session, plan, 256 if max_jobs is None else max_jobs)
        return
    if output_format == "json":
        data: dict[str, Any] = {
            "cells": [
                {
                    "cell": c.key, "id": cell_id(c.key), "case": c.case.name, "backend": c.runtime.backend,
                    "version": c.runtime.version,
                    "tag": c.runtime.tag, "arm": c.case.arm, "gpus": c.case.gpus_needed,
                    "markers": list(c.case.marker_texts), "missing_fixes": list(c.missing_fixes),
                    "note": c.expected_failure,
                }
                for c in plan.cells
            ]
        }  # fmt: skip
        if explain:
            data["excluded"] = [{"case": e.case, "runtime": e.runtime, "reason": e.reason} for e in plan.excluded]
        print_json(data)
        return
    rows = [(c.case.name, c.runtime.backend, c.runtime.version, c.case.arm, c.case.gpus_needed, c.expected_failure)
            for c in plan.cells]  # fmt: skip
    print_table(("case", "backend", "version", "arm", "gpus", "note"), rows)
    click.echo(
        f"{len(plan.cells)} cells ({len({c.case.name for c in plan.cells})} cases), {len(plan.excluded)} excluded"
    )
    if explain and plan.excluded:
        print_table(("case", "runtime", "excluded because"), [(e.case, e.runtime, e.reason) for e in plan.excluded])


@cli.command("run")
@selection_options
@click.option("-j", "--jobs", type=int, help="Cells at once (default: the number of slots).")
@click.option("--gpus", "gpus", metavar="LIST", help="Only these GPUs: NVML indices or UUIDs, e.g. 0,2.")
@click.option("--pack", is_flag=True, help="Share a GPU between cells while their memory budgets fit.")
@click.option(
    "--max-attempts",
    type=int,
    default=1,
    show_default=True,
    help="Retry startup/health/infra failures (never validation failures) up to N attempts.",
)
@click.option(
    "--repeat", type=int, default=1, show_default=True, metavar="N",
    help="Run each cell N times, each a separate attempt (pass rates with Wilson intervals; timing samples).",
)  # fmt: skip
@click.option("-x", "--fail-fast", is_flag=True, help="Start no new cell after the first failure.")
@click.option("--resume", type=int, metavar="CAMPAIGN", help="Run the cells of CAMPAIGN that have no finished attempt.")
@click.option(
    "--rerun-failed",
    type=int,
    metavar="CAMPAIGN",
    is_flag=False,
    flag_value=0,
    help="Rerun the cells whose latest attempt failed, as new attempts (default: the latest campaign).",
)
@click.option(
    "--join", type=int, metavar="CAMPAIGN",
    help="Help with running CAMPAIGN (e.g. from another host on a shared PostgreSQL database): run its "
    "cells no runner has claimed yet.",
)  # fmt: skip
@click.option("--logs-dir", type=click.Path(path_type=Path), help="Where cell logs go (default: data dir/runs).")
@click.option("--workspace", type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="A checkout (e.g. of Dynamo) that cases' launch scripts resolve against.")
@click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where cells run: threads on this host, or tasks on a Ray cluster (needs disagg-matrix[ray]).")
@click.option("--ray-address", metavar="auto|HOST:PORT",
              help="With --executor ray: the cluster to use (`auto`: the one `ray start` left running here); "
              "default: start a local cluster for this run.")
@click.option("--json-events", is_flag=True, help="Print one JSON object per event instead of the live view.")
@click.option("--quiet", "-q", is_flag=True, help="Only the summary.")
@click.option("--report/--no-report", default=True, show_default=True, help="Refresh the HTML report at the end.")
@click.option("--report-dir", type=click.Path(path_type=Path), help="Where the report goes (default: data dir/report).")
@click.option("--cell", "cell_args", multiple=True, metavar="ID[,ID...]",
              help="Run exactly these cells: stable ids from `matrix plan --json`/`--format github-matrix`, or "
              "CASE@BACKEND-VERSION. Repeatable.")
@click.option("--results-out", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
              help="After the run, write the campaign's outcomes (with log tails) to FILE for `matrix import`.")
@click.option("--campaign-key", envvar="MATRIX_CAMPAIGN_KEY", metavar="KEY",
              help="Shards with one key import into one campaign. Default: $MATRIX_CAMPAIGN_KEY, else the GitHub "
              "run (repository and run id), else a new uuid.")
@click.option("--find-links", type=click.Path(path_type=Path), metavar="DIR",
              help="A wheelhouse (`matrix runtime wheelhouse --out DIR`) that provisioning also takes wheels from.")
@click.option("--offline", is_flag=True, help="Provision venv runtimes from the --find-links wheelhouse only.")
@click.option("--new", "new_only", is_flag=True,
              help="Only the cells of runtimes nobody has run yet (e.g. just added by `matrix discover`).")
@pass_app
def run_cmd(
    app: App, /, jobs: int | None, gpus: str | None, pack: bool, max_attempts: int, repeat: int, fail_fast: bool,
    resume: int | None, rerun_failed: int | None, join: int | None, logs_dir: Path | None, workspace: Path | None,
    executor: str, ray_address: str | None, json_events: bool, quiet: bool, report: bool, report_dir: Path | None,
    cell_args: tuple[str, ...], results_out: Path | None, campaign_key: str | None, find_links: Path | None,
    offline: bool, new_only: bool, **kw: Any,
) -> None:  # fmt: skip
    """Run the planned cells: launch each pair, send the request, validate, record.

    Cells run concurrently on slots (one cell per GPU, or packed with --pack; CPU cells on CPU slots),
    longest expected first. With --executor ray each cell is a Ray task asking for its GPUs; this
    process still plans, claims and records. Exit code: 0 when every cell passed (skips allowed), 1 when any failed,
    2 on bad input, 3 when interrupted.
    """
    from matrix.campaign import RunOptions, run_campaign
    from matrix.cli_runtime import provision_source
    from matrix.fanout import check_campaign_key, default_campaign_key, split_cell_args
    from matrix.hardware.gpus import parse_gpu_list
    from matrix.paths import usable_dir

    if resume is not None and rerun_failed is not None:
        raise click.UsageError("use --resume or --rerun-failed, not both")
    if join is not None:
        _check_join_options(resume, rerun_failed, kw)
    cells = split_cell_args(cell_args)
    if cell_args and not cells:
        raise click.UsageError("--cell needs at least one cell id")
    if cells and (resume is not None or rerun_failed is not None or join is not None):
        raise click.UsageError(
            "--cell starts a new campaign; it cannot be combined with --resume, --rerun-failed or --join"
        )
    if new_only and (resume is not None or rerun_failed is not None or join is not None):
        raise click.UsageError("--new starts a new campaign of never-run runtimes; drop --resume/--rerun-failed/--join")
    if campaign_key is not None or results_out is not None:
        campaign_key = check_campaign_key(campaign_key if campaign_key is not None else default_campaign_key())
    if results_out is not None:
        from matrix.cli_fanout import check_results_path

        check_results_path(results_out)
    source = provision_source(find_links, offline)  # checked before a campaign exists
    if logs_dir is not None:
        usable_dir(logs_dir, "--logs-dir")
    if report and report_dir is not None:
        usable_dir(report_dir, "--report-dir")
    ran: list[int] = []
    options = RunOptions(
        selection=make_selection(**kw), logs_dir=logs_dir, quiet=quiet, json_events=json_events, jobs=jobs,
        max_attempts=max_attempts, fail_fast=fail_fast, pack=pack,
        gpus=tuple(parse_gpu_list(gpus)) if gpus is not None else None, resume=resume, rerun_failed=rerun_failed,
        join=join, workspace=workspace.resolve() if workspace else None, executor=executor, ray_address=ray_address,
        cells=cells, campaign_key=campaign_key or "", on_campaign=ran.append, provision_source=source,
        new_only=new_only, repeat=repeat,
    )  # fmt: skip
    from matrix.output import echo

    exit_code = run_campaign(app.sessions(), options, echo=echo)
    if results_out is not None:
        from matrix.cli_fanout import write_results_file

        write_results_file(app.sessions(), ran, results_out, campaign_key or "", err=json_events)
    if report and exit_code != 2:
        from matrix.db.engine import transaction
        from matrix.paths import data_dir
        from matrix.report import write_report

        with transaction(app.sessions()) as session:
            index = write_report(session, report_dir or data_dir() / "report", options.selection)
        click.echo(f"report: {index}", err=json_events)
    raise SystemExit(exit_code)


def _check_join_options(resume: int | None, rerun_failed: int | None, kw: dict[str, Any]) -> None:
    """`--join` runs the joined campaign's own cells: other ways of choosing cells contradict it."""
    if resume is not None or rerun_failed is not None:
        raise click.UsageError(
            "--join helps with a running campaign; --resume/--rerun-failed restart a stopped one: use one of them"
        )
    flags = {"marker_expression": "-m", "since": "--since", "until": "--until", "backends": "--backend",
             "cases": "--case", "runtimes": "--runtime"}  # fmt: skip
    given = [flag for key, flag in flags.items() if kw.get(key)]
    if given:
        raise click.UsageError(f"--join runs the cells the joined campaign selected; drop {', '.join(given)}")


@cli.command("gpus")
@json_option
def gpus_cmd(as_json: bool) -> None:
    """Show the GPUs NVML sees (index, UUID, name, memory). A host without GPUs is fine."""
    from matrix.hardware.gpus import format_inventory, inventory
    from matrix.output import print_json, print_table

    gpus = inventory()
    if as_json:
        print_json([vars(g) if hasattr(g, "__dict__") else g.__dict__ for g in gpus])
        return
    if not gpus:
        click.echo("no GPUs (NVML not available or no devices): GPU cells will be skipped, CPU cells run")
        return
    print_table(("index", "uuid", "name", "total GiB", "used GiB", "free GiB"), format_inventory(gpus))


@cli.command("show")
@click.argument("cell")
@json_option
@with_session
def show_cmd(session: Session, cell: str, as_json: bool) -> None:
    """Show one cell attempt: by MATRIX_CELL_ID, by row id, or CASE@BACKEND-VERSION (latest attempt)."""
    from matrix.report.text import clean_data
    from matrix.results import describe_cell, find_cell

    row = find_cell(session, cell)
    # Redacted and printable like every other exit: the row may predate redaction, or come from a shard.
    details = clean_data(describe_cell(row))
    if as_json:
        from matrix.output import print_json

        print_json(details)
        return
    for key, value in details.items():
        if key == "checks":
            for check in value:
                if isinstance(check, dict):
                    click.echo(f"  check failed: {check.get('name', '')}: {check.get('message', '')}")
        elif key == "logs":
            for role, path in value.items():
                click.echo(f"  log {role}: {path}")
        elif value not in (None, "", {}, []):
            click.echo(f"{key}: {value}")


# Commands that live in their own modules (kept out of this file so it stays a thin table of contents).
from matrix.cli_fanout import register as _register_fanout_commands  # noqa: E402
from matrix.cli_report import register as _register_report_commands  # noqa: E402
from matrix.cli_runtime import register as _register_runtime_commands  # noqa: E402
from matrix.cli_versions import register as _register_version_commands  # noqa: E402

_register_runtime_commands(cli)
_register_version_commands(cli)
_register_report_commands(cli)
_register_fanout_commands(cli)
