"""`matrix plan`, `run`, `show` and `gpus`: what is selected, running it, and one cell's outcome."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from matrix.cli.app import App, json_option, make_selection, pass_app, selection_options, skew_options, with_session
from matrix.cli.quarantine import auto_quarantine_options, record_quarantines

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from matrix.schedule.makespan import Forecast
    from matrix.schedule.start import Start


@click.command("plan")
@selection_options
@skew_options
@click.option("--explain", is_flag=True, help="Also list every excluded combination with its reason.")
@click.option("--with", "with_components", multiple=True, metavar="COMPONENT=VERSION",
              help="Preview the variants `run --with` would run (nothing is stored); repeatable.")
@click.option("--resolve", is_flag=True,
              help="First resolve each planned venv runtime's recipe for its own target with uv (metadata only) "
                   "and refuse, naming what is missing, when no index has a requirement.")  # fmt: skip
@click.option("--new", "new_only", is_flag=True,
              help="Only the cells of runtimes nobody has run yet, as `run --new` would run them.")
@click.option("--makespan", is_flag=True,
              help="Also predict how long `matrix run` of these cells takes on this host, from the cases' earlier "
                   "attempts (medians; a case without one counts its timeouts) and the scheduler's own rules.")
@click.option("--gpus", "gpus", metavar="LIST", help="With --makespan: only these GPUs, as `run --gpus`.")
@click.option("--pack", is_flag=True, help="With --makespan: share a GPU between cells, as `run --pack`.")
@click.option("-j", "--jobs", type=int, help="With --makespan: cells at once, as `run -j` (default: the slots).")
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
    session: Session, explain: bool, resolve: bool, as_json: bool, output_format: str | None, max_jobs: int | None,
    with_components: tuple[str, ...], makespan: bool, gpus: str | None, pack: bool, jobs: int | None, new_only: bool,
    **kw: Any,
) -> None:  # fmt: skip
    """Expand cases x runtimes into cells and print them.

    `matrix plan -m "pre_merge and sidecar and gpu_1"` answers which cases a CI expression collects.
    Cells whose runtime lacks a required fix are kept and annotated: they are expected to fail.
    `--format github-matrix` prints the shards for a CI fan-out (see docs/scale-out.md).
    """
    from matrix.catalog.queries import plan_from_db
    from matrix.output import print_json, print_table

    if as_json and output_format not in (None, "json"):
        raise click.UsageError("--json is --format json; give one of them")
    output_format = output_format or ("json" if as_json else "table")
    if max_jobs is not None and output_format != "github-matrix":
        raise click.UsageError("--max-jobs applies to --format github-matrix")
    if explain and output_format == "github-matrix":
        raise click.UsageError("--explain applies to --format table or json")
    if not makespan and (gpus is not None or pack or jobs is not None):
        raise click.UsageError("--gpus, --pack and -j go with --makespan in `plan` (they are `run`'s options)")
    if makespan and output_format == "github-matrix":
        raise click.UsageError("--makespan applies to --format table or json")
    if jobs is not None and jobs < 1:
        raise click.UsageError("-j/--jobs must be at least 1")
    selection = make_selection(**kw)
    if with_components:
        from matrix.component_sources import parse_changes
        from matrix.variants import preview_selection

        plan = preview_selection(session, selection, parse_changes(with_components))
        selection = plan.selection
    else:
        plan = plan_from_db(session, selection)
    if new_only:
        from dataclasses import replace

        from matrix.catalog.queries import of_new_runtimes

        plan = replace(plan, cells=tuple(of_new_runtimes(session, plan.cells)))
    if resolve:
        from matrix.launch.providers.wheelresolve import refuse_unresolvable

        refuse_unresolvable({c.runtime.label: c.runtime for c in plan.cells}.values())
    if output_format == "github-matrix":
        from matrix.cli.fanout import print_github_matrix

        print_github_matrix(session, plan, 256 if max_jobs is None else max_jobs)
        return
    predicted = _forecast(session, plan.cells, gpus, pack, jobs) if makespan else None
    if output_format == "json":
        document = plan.as_dict(explain=explain)
        if predicted is not None:
            document["makespan"] = asdict(predicted)
        print_json(document)
        return
    rows = [(c.case.name, c.runtime.backend, _versions(c), c.case.arm, c.case.gpus_needed, c.expected_failure)
            for c in plan.cells]  # fmt: skip
    print_table(("case", "backend", "version", "arm", "gpus", "note"), rows)
    click.echo(
        f"{len(plan.cells)} cells ({len({c.case.name for c in plan.cells})} cases), {len(plan.excluded)} excluded"
    )
    if predicted is not None:
        click.echo(_forecast_line(predicted))
    if with_components:
        click.echo("the variants are previewed, not stored: `matrix run --with` with these options makes and runs them")
    if explain and plan.excluded:
        print_table(("case", "runtime", "excluded because"), [(e.case, e.runtime, e.reason) for e in plan.excluded])
    if explain and selection.skewed:
        from matrix.cells import ROLES, cell_id

        print_table(("cell", "id", *ROLES), [(c.key, cell_id(c.key), *(c.runtime_of(r).version for r in ROLES))
                                             for c in plan.cells])  # fmt: skip


def _forecast(session: Session, cells: Any, gpus: str | None, pack: bool, jobs: int | None) -> Forecast:
    from matrix.campaign import forecast_cells
    from matrix.hardware.gpus import inventory, parse_gpu_list

    restrict = parse_gpu_list(gpus) if gpus is not None else None
    return forecast_cells(session, cells, inventory(restrict=restrict), pack=pack, jobs=jobs)


def _forecast_line(f: Forecast) -> str:
    from matrix.report.fmt import fmt_seconds

    line = (
        f"predicted makespan on this host: {fmt_seconds(f.makespan_s)} for {f.cells} cell(s), {f.workers} at once "
        f"(one after another: {fmt_seconds(f.sum_s)}; the slowest cell {fmt_seconds(f.slowest_s)})"
    )
    if f.cells > f.from_history:
        line += f"; {f.cells - f.from_history} without an earlier attempt count their timeouts"
    if f.cannot_run:
        line += f"; {f.cannot_run} this host cannot run are left out"
    return line


def _versions(cell: Any) -> str:
    """A diagonal cell's version, or a skew cell's `prefill=A decode=B`."""
    return " ".join(f"{role}={v}" for role, v in cell.role_versions.items()) or str(cell.runtime.version)


@click.command("run")
@selection_options
@skew_options
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
@click.option("--loopback-only", is_flag=True,
              help="Fail a cell whose processes listen beyond 127.0.0.1/::1 (check loopback_only).")
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
@click.option("--report/--no-report", default=True, show_default=True,
              help="Refresh the HTML report of the whole database at the end (not after an interruption).")
@click.option("--report-dir", type=click.Path(path_type=Path), help="Where the report goes (default: data dir/report).")
@click.option("--cell", "cell_args", multiple=True, metavar="ID[,ID...]",
              help="Run exactly these cells: stable ids from `matrix plan --json`/`--format github-matrix` (skew "
              "cells' too, without --skew), or CASE@BACKEND-VERSION / CASE@BACKEND[prefill=A,decode=B]. Repeatable.")
@click.option("--results-out", type=click.Path(path_type=Path, dir_okay=False), metavar="FILE",
              help="After the run, write the campaign's outcomes (with log tails) to FILE for `matrix import`.")
@click.option("--campaign-key", envvar="MATRIX_CAMPAIGN_KEY", metavar="KEY",
              help="Shards with one key import into one campaign. Default: $MATRIX_CAMPAIGN_KEY, else the GitHub "
              "run (repository and run id), else a new uuid.")
@click.option("--find-links", type=click.Path(path_type=Path), metavar="DIR",
              help="A wheelhouse (`matrix runtime wheelhouse --out DIR`) that provisioning also takes wheels from.")
@click.option("--offline", is_flag=True, help="Provision venv runtimes from the --find-links wheelhouse only.")
@click.option("--with", "with_components", multiple=True, metavar="COMPONENT=VERSION",
              help="Run variants of the selected runtimes with this component changed (e.g. vllm-rs=0.30.0), "
                   "everything else held equal; repeatable.")
@click.option("--new", "new_only", is_flag=True,
              help="Only the cells of runtimes nobody has run yet (e.g. just added by `matrix discover`).")
@click.option("--notify", "notify_url", envvar="MATRIX_NOTIFY_URL", metavar="URL",
              help="After the run, post each failure episode this run opened or closed to this webhook (JSON, "
              "Slack-compatible), and retry events earlier runs failed to post. Default: $MATRIX_NOTIFY_URL.")
@auto_quarantine_options
@click.option("--per-cell-engines", is_flag=True,
              help="Skew and fault grids: start both engines of every pair for that pair alone, instead of "
              "starting each (role, runtime) engine once per grid and routing each pair through its own proxy "
              "(a fault grid: cases that differ only in `kv_fault`).")
@pass_app
def run_cmd(
    app: App, /, jobs: int | None, gpus: str | None, pack: bool, max_attempts: int, repeat: int, fail_fast: bool,
    resume: int | None, rerun_failed: int | None, join: int | None, logs_dir: Path | None, workspace: Path | None,
    executor: str, ray_address: str | None, json_events: bool, quiet: bool, report: bool, report_dir: Path | None,
    cell_args: tuple[str, ...], results_out: Path | None, campaign_key: str | None, find_links: Path | None,
    offline: bool, new_only: bool, loopback_only: bool, with_components: tuple[str, ...], per_cell_engines: bool,
    notify_url: str | None, auto_quarantine: bool, quarantine_window_days: int, quarantine_clean_runs: int,
    **kw: Any,
) -> None:  # fmt: skip
    """Run the planned cells: launch each pair, send the request, validate, record.

    Cells run concurrently on slots (one cell per GPU, or packed with --pack; CPU cells on CPU slots),
    longest expected first. With --executor ray each cell is a Ray task asking for its GPUs; this
    process still plans, claims and records. Exit code: 0 when every cell passed (skips allowed), 1 when any failed,
    2 on bad input, 3 when interrupted.
    """
    from matrix.campaign import RunOptions, run_campaign
    from matrix.cli.runtime import provision_source
    from matrix.fanout.shards import check_campaign_key, default_campaign_key, split_cell_args
    from matrix.hardware.gpus import parse_gpu_list
    from matrix.paths import usable_dir

    start = _start(resume, rerun_failed, join, cells=bool(cell_args), new_only=new_only,
                   variants=bool(with_components), repeat=repeat, kw=kw)  # fmt: skip
    if notify_url:
        from matrix.notify import check_url

        check_url(notify_url)  # before a campaign exists: a bad URL is exit 2 with nothing written
    from matrix.executors.shared_engines import start_slots

    start_slots()  # MATRIX_GRID_START_SLOTS, read again by each grid: a bad value stops here, nothing run
    cells = split_cell_args(cell_args)
    if cell_args and not cells:
        raise click.UsageError("--cell needs at least one cell id")
    if campaign_key is not None or results_out is not None:
        campaign_key = check_campaign_key(campaign_key if campaign_key is not None else default_campaign_key())
    if results_out is not None:
        from matrix.cli.fanout import check_results_path

        check_results_path(results_out)
    source = provision_source(find_links, offline)  # checked before a campaign exists
    if logs_dir is not None:
        usable_dir(logs_dir, "--logs-dir")
    if report and report_dir is not None:
        usable_dir(report_dir, "--report-dir")
    ran: list[int] = []
    selection = make_selection(**kw)
    if with_components:
        selection = _with_variants(app, selection, with_components)
    options = RunOptions(
        selection=selection, logs_dir=logs_dir, quiet=quiet, json_events=json_events, jobs=jobs,
        max_attempts=max_attempts, fail_fast=fail_fast, pack=pack,
        gpus=tuple(parse_gpu_list(gpus)) if gpus is not None else None, start=start,
        workspace=workspace.resolve() if workspace else None, executor=executor, ray_address=ray_address,
        cells=cells, campaign_key=campaign_key or "", on_campaign=ran.append, provision_source=source,
        new_only=new_only, repeat=repeat, loopback_only=loopback_only, shared_engines=not per_cell_engines,
    )  # fmt: skip
    from matrix.output import echo

    exit_code = run_campaign(app.sessions(), options, echo=echo)
    if results_out is not None:
        from matrix.cli.fanout import write_results_file

        write_results_file(app.sessions(), ran, results_out, campaign_key or "", err=json_events)
    if exit_code != 2:
        _quarantine(app, ran, auto_quarantine, quarantine_window_days, quarantine_clean_runs, err=json_events)
    if notify_url and exit_code != 2:
        _notify(app, notify_url, ran, exit_code, err=json_events)
    if report and exit_code != 2:
        _refresh_report(app, report_dir, exit_code, ran, err=json_events)
    raise SystemExit(exit_code)


def _quarantine(app: App, ran: list[int], auto: bool, window_days: int, clean_runs: int, *, err: bool) -> None:
    """Record the quarantine exits (expired, clean runs) and, with --auto-quarantine, the automatic entries this
    run's campaigns call for (`matrix.quarantine`); one line per event. The run's exit code stays its own."""
    from matrix.db.engine import transaction

    with transaction(app.sessions()) as session:
        lines = record_quarantines(session, ran, auto, window_days, clean_runs)
    for line in lines:
        click.echo(line, err=err)


def _notify(app: App, url: str, ran: list[int], exit_code: int, *, err: bool) -> None:
    """Record the episode events of this run's campaigns and post what is not yet sent (`matrix.notify`).

    Whatever happens here leaves the exit code alone: a notification reports verdicts, it is not one. After an
    interruption the events are only recorded: whoever pressed Ctrl-C wants the prompt back, and the next run
    (or `matrix notify`) posts them."""
    from matrix.campaign import EXIT_INTERRUPTED
    from matrix.db.engine import transaction
    from matrix.notify import notify, record_events, summary_line
    from matrix.text import clean

    try:
        if exit_code == EXIT_INTERRUPTED:
            with transaction(app.sessions()) as session:
                recorded = record_events(session, ran)
            click.echo(f"notify: {recorded} event(s) recorded, not posted (run interrupted): "
                       "`matrix notify` or the next run posts them", err=err)  # fmt: skip
            return
        recorded, done = notify(app.sessions(), url, ran)
    except Exception as exc:  # a broken notification must not turn a verdict into a traceback
        click.echo(f"notify: not posted ({type(exc).__name__}: {clean(str(exc))[:300]}); the next run retries",
                   err=err)  # fmt: skip
        return
    click.echo(summary_line(url, recorded, done), err=err)


def _refresh_report(app: App, report_dir: Path | None, exit_code: int, ran: list[int], *, err: bool) -> None:
    """The report of the whole database, whatever this run selected: an index of only the last selection
    would drop the links to every other runtime's pages. Only the pages this run's campaigns reach are
    rewritten when the report there came from the same inputs (a year of nightlies is thousands of pages).
    Not after an interruption: whoever pressed Ctrl-C wants the prompt back."""
    from matrix.campaign import EXIT_INTERRUPTED

    if exit_code == EXIT_INTERRUPTED:
        click.echo("report not refreshed (run interrupted): `matrix report` refreshes it", err=err)
        return
    from matrix.db.engine import transaction
    from matrix.paths import data_dir
    from matrix.report import refresh_report

    started = time.perf_counter()
    with transaction(app.sessions()) as session:
        written = refresh_report(session, report_dir or data_dir() / "report", ran)
    how = f"{written.pages} pages refreshed" if written.partial else f"{written.pages} pages written"
    click.echo(f"report: {written.index} ({how} in {time.perf_counter() - started:.1f} s)", err=err)


def _with_variants(app: App, selection: Any, values: tuple[str, ...]) -> Any:
    """--with: derive (or find) the variants of the selected runtimes in one transaction, select those."""
    from matrix.component_sources import parse_changes
    from matrix.db.engine import transaction
    from matrix.variants import derive_selection

    changes = parse_changes(values)
    with transaction(app.sessions()) as session:
        return derive_selection(session, selection, changes)


# The selection options by parameter name: `--join` takes the joined campaign's selection instead.
_SELECTION_FLAGS = {"marker_expression": "-m", "since": "--since", "until": "--until", "backends": "--backend",
                    "cases": "--case", "runtimes": "--runtime", "skew": "--skew", "skew_frontend": "--skew-frontend",
                    "prefill_runtime": "--prefill-runtime", "decode_runtime": "--decode-runtime"}  # fmt: skip


def _start(
    resume: int | None, rerun_failed: int | None, join: int | None, *, cells: bool, new_only: bool, variants: bool,
    repeat: int, kw: dict[str, Any],
) -> Start:  # fmt: skip
    """The run's start mode (`matrix.schedule.start`), every option it contradicts refused here, before anything
    is read or written: one usage error each (exit 2)."""
    from matrix.schedule.start import Start, StartConflict

    try:
        start = Start.from_flags(resume, rerun_failed, join)
        selecting = [flag for key, flag in _SELECTION_FLAGS.items() if kw.get(key)]
        start.check(cells=cells, new_only=new_only, variants=variants, repeat=repeat, selecting=selecting)
    except StartConflict as exc:
        raise click.UsageError(str(exc)) from None
    return start


@click.command("gpus")
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


@click.command("show")
@click.argument("cell")
@json_option
@with_session
def show_cmd(session: Session, cell: str, as_json: bool) -> None:
    """Show one cell attempt: by MATRIX_CELL_ID, by row id, or CASE@BACKEND-VERSION (latest attempt).

    Formatted like the report (seconds, byte units, words); --json has every stored value and digit."""
    from matrix.results_read import describe_cell, find_cell
    from matrix.text import clean_data

    row = find_cell(session, cell)
    # Redacted and printable like every other exit: the row may predate redaction, or come from a shard.
    details = clean_data(describe_cell(row))
    if as_json:
        from matrix.output import print_json

        print_json(details)
        return
    from matrix.report.show import show_lines

    click.echo("\n".join(show_lines(details)))


def register(cli: click.Group) -> None:
    for command in (plan_cmd, run_cmd, show_cmd, gpus_cmd):
        cli.add_command(command)
