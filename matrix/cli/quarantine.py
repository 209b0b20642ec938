"""Quarantine commands: `matrix quarantine`, `unquarantine` and `quarantines` (`matrix.quarantine`).

`register(cli)` adds them to the main group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from matrix.cli.app import json_option, with_session

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["auto_quarantine_options", "record_quarantines", "register"]

F = TypeVar("F", bound=Callable[..., Any])


def auto_quarantine_options(func: F) -> F:
    """`--auto-quarantine`, `--quarantine-window-days`, `--quarantine-clean-runs`: for `run` and `import`."""
    options = [
        click.option("--auto-quarantine/--no-auto-quarantine", envvar="MATRIX_AUTO_QUARANTINE", default=False,
                     help="Afterwards, mute each cell that failed in these campaigns and also passed within the "
                     "window (flake evidence: `matrix quarantines`). Default: $MATRIX_AUTO_QUARANTINE, else off."),
        click.option("--quarantine-window-days", type=click.IntRange(1, 3650), default=7, show_default=True,
                     envvar="MATRIX_QUARANTINE_WINDOW_DAYS", help="How far back a pass counts as flake evidence."),
        click.option("--quarantine-clean-runs", type=click.IntRange(1, 1000), default=3, show_default=True,
                     envvar="MATRIX_QUARANTINE_CLEAN_RUNS",
                     help="Consecutive passes after which an automatic quarantine ends (recorded with the entry)."),
    ]  # fmt: skip
    for option in reversed(options):
        func = option(func)
    return func


def record_quarantines(
    session: Session, campaign_ids: Iterable[int], auto: bool, window_days: int, clean_runs: int
) -> list[str]:
    """The quarantine exits (expired, clean runs) and, with `auto`, the automatic entries `campaign_ids` call for
    (`matrix.quarantine.update_after_run`); one line per event."""
    import datetime as dt

    from matrix.quarantine import AutoRule, update_after_run

    rule = AutoRule(window_days, clean_runs) if auto else None
    return update_after_run(session, campaign_ids, rule, dt.datetime.now(dt.UTC))


@click.command("quarantine")
@click.argument("case")
@click.option(
    "--runtime",
    "runtime_spec",
    metavar="BACKEND=V",
    help="Mute the cell of this runtime only (default: every runtime of the case).",
)
@click.option("--owner", required=True, help="Who answers for the muted cell (a name or a team).")
@click.option(
    "--until",
    "until_text",
    required=True,
    metavar="YYYY-MM-DD",
    help="The last day (UTC) the cell is muted; today or later.",
)
@click.option("--reason", required=True, help="Why it is muted (one line, e.g. an issue link).")
@with_session
def quarantine_cmd(session: Session, case: str, runtime_spec: str | None, owner: str, until_text: str,
                   reason: str) -> None:  # fmt: skip
    """Mute a cell: it still runs and is recorded, but its failures do not block a gate, which lists it as
    muted. Bad input (an unknown case or runtime, a day in the past, an empty owner) changes nothing, exit 2."""
    import datetime as dt

    from matrix.quarantine import enter, parse_until
    from matrix.report.muted import view

    now = dt.datetime.now(dt.UTC)
    row = enter(session, case, runtime_spec, owner, parse_until(until_text, now.date()), reason, now)
    click.echo(f"muted {view(row).cell}: {view(row).describe()}")


@click.command("unquarantine")
@click.argument("case")
@click.option("--runtime", "runtime_spec", metavar="BACKEND=V", help="End only the quarantine of this runtime.")
@click.option("--reason", required=True, help="Why it ends (recorded with the exit).")
@with_session
def unquarantine_cmd(session: Session, case: str, runtime_spec: str | None, reason: str) -> None:
    """End the case's quarantines in force (exit `manual`, with the reason); the rows stay on record."""
    import datetime as dt

    from matrix.quarantine import release
    from matrix.report.muted import view

    for row in release(session, case, runtime_spec, reason, dt.datetime.now(dt.UTC)):
        click.echo(f"released {view(row).cell}: {view(row).exit_reason}")


@click.command("quarantines")
@click.option("--all", "show_all", is_flag=True, help="Also the quarantines that ended, with how and why.")
@json_option
@with_session
def quarantines_cmd(session: Session, show_all: bool, as_json: bool) -> None:
    """Muted cells: owner, until, how each entered (manual, or automatic with its evidence) and, with --all,
    how each exited (manual, expired, clean runs)."""
    import datetime as dt

    from matrix.output import print_json, print_table
    from matrix.report.muted import load_quarantines
    from matrix.text import clean, clean_data

    today = dt.datetime.now(dt.UTC).date()
    found = [q for q in load_quarantines(session) if show_all or q.active(today)]
    if as_json:
        print_json({"quarantines": [clean_data({**q.as_dict(), "in_force": q.active(today)}) for q in found]})
        return
    rows = []
    for q in found:
        state = "muted" if q.active(today) else f"ended ({q.exit or 'expired'})"
        until = q.ends or "-"
        ended = clean(q.exit_reason) if q.exit else ""
        rows.append((state, q.cell, clean(q.owner), until, q.entry, ", ".join(q.evidence) or "-", clean(q.reason),
                     ended))  # fmt: skip
    print_table(("state", "cell", "owner", "until", "entry", "evidence", "reason", "exit"), rows)
    muted = sum(1 for q in found if q.active(today))
    click.echo(f"{len(found)} quarantine(s), {muted} in force" + ("" if found else ": nothing is muted"))


def register(cli: click.Group) -> None:
    """Add `quarantine`, `unquarantine` and `quarantines` to the `matrix` group."""
    for command in (quarantine_cmd, unquarantine_cmd, quarantines_cmd):
        cli.add_command(command)
