"""`matrix skew CASE`: the case's version-skew grid, rows prefill, columns decode, one class per cell."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from matrix.cli.app import json_option, with_session

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@click.command("skew")
@click.argument("case")
@json_option
@with_session
def skew_cmd(session: Session, case: str, as_json: bool) -> None:
    """Show CASE's prefill x decode grid (from `matrix run --skew`): works, clean-reject, hang,
    error-answer, healthy-but-wrong, crash or not-run per pair, with the reason. With a Dynamo frontend axis,
    one grid per frontend version."""
    from matrix.output import print_json, print_table
    from matrix.report.skew import load_skew_grid

    grid = load_skew_grid(session, case)
    if as_json:
        print_json(grid.as_dict())
        return
    if not grid.entries:
        click.echo(f"{case}: no finished attempts yet; run `matrix run --case {case} --skew`")
        return
    for frontend in grid.frontends or (None,):
        title = f"{case} ({grid.backend})" + (f", {grid.role_options}" if grid.role_options else "")
        title += f", frontend {frontend}" if frontend else ""
        click.echo(f"{title}: rows prefill, columns decode")
        rows = []
        for prefill in grid.versions:
            cells = [grid.at(prefill, decode, frontend) for decode in grid.versions]
            rows.append((prefill, *(e.label if e else "-" for e in cells)))
        print_table(("prefill \\ decode", *grid.versions), rows)
    reasons = [
        (e.cell, e.label, "\n".join((e.verdict.reason, *(f"* an earlier attempt disagreed: {d}" for d in e.disagreed))))
        for e in grid.entries if e.verdict.cls != "works" or e.disagreed
    ]  # fmt: skip
    if reasons:
        print_table(("cell", "class", "reason"), reasons)
    if any(e.disagreed for e in grid.entries):
        click.echo("* an earlier attempt of that pair was classed otherwise (the latest finished attempt decides)")


def register(cli: click.Group) -> None:
    cli.add_command(skew_cmd)
