"""`matrix evidence`: the age of each required cell's latest evidence per gate policy (`matrix.report.evidence`).

`register(cli)` adds it to the main group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from matrix.cli.app import json_option, with_session

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["register"]


@click.command("evidence")
@click.option(
    "--policy",
    "policies",
    multiple=True,
    metavar="NAME",
    help="Only this gate policy (repeatable; default: every policy of the catalog).",
)
@click.option(
    "--days",
    type=click.IntRange(0, 3650),
    default=5,
    show_default=True,
    help="Evidence newer than this many days counts as fresh.",
)
@click.option("--stale", "stale_only", is_flag=True, help="List only the cells whose evidence is not fresh.")
@json_option
@with_session
def evidence_cmd(session: Session, policies: tuple[str, ...], days: int, stale_only: bool, as_json: bool) -> None:
    """For each required cell of a gate policy, the date and age of its latest evidence (a pass or a failure;
    skips prove nothing), and the share of required cells with evidence newer than --days. Exit 0."""
    from matrix.output import print_json, print_table
    from matrix.report.evidence import evidence_age

    found = evidence_age(session, days, policies=policies or None)
    if as_json:
        print_json({"policies": [p.as_dict() for p in found]})
        return
    for policy in found:
        rows = [
            (c.runtime, c.case, c.status or "never run", c.finished_at.date().isoformat() if c.finished_at else "-",
             f"{c.age_days:.1f}" if c.age_days is not None else "-", "yes" if c.fresh else "no")
            for c in policy.cells if not (stale_only and c.fresh)
        ]  # fmt: skip
        if rows:
            print_table(("runtime", "case", "latest", "date", "age (days)", "fresh"), rows)
        click.echo(policy.summary())


def register(cli: click.Group) -> None:
    """Add `evidence` to the `matrix` group."""
    cli.add_command(evidence_cmd)
