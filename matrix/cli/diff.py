"""`matrix diff CAMPAIGN_A CAMPAIGN_B`: what changed between two campaigns, cell by cell (`matrix.report.diff`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from matrix.cli.app import json_option, with_session

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

__all__ = ["register"]


@click.command("diff")
@click.argument("campaign_a")
@click.argument("campaign_b")
@click.option(
    "--fail-on", type=click.Choice(["never", "new", "slow", "failure"]), default="new", show_default=True,
    help="Exit 1 when B has new failures (new), also newly slow cells (slow), also cells still failing (failure).",
)  # fmt: skip
@click.option("--threshold", type=float, default=0.10, show_default=True,
              help="Newly slow must also be worse than this fraction (0.10 = 10 %).")  # fmt: skip
@click.option("--alpha", type=float, default=0.01, show_default=True,
              help="Significance level of the Mann-Whitney test.")  # fmt: skip
@json_option
@with_session
def diff_cmd(
    session: Session, campaign_a: str, campaign_b: str, fail_on: str, threshold: float, alpha: float, as_json: bool
) -> None:
    """What changed from CAMPAIGN_A to CAMPAIGN_B: new failures, still failing, fixed, newly slow, not run.

    \b
    matrix diff 41 42            campaign 41 against campaign 42
    matrix diff last~1 last      the newest campaign against the one before it
    Each cell (case x runtime) is judged by its standing attempt within each campaign. Failures are grouped
    by signature: the failure kind and the message's first line with numbers, ids, uuids, paths, hosts and
    ports written as <n>, <id>, <path>, <host>, <port>, so many cells failing for one reason are one line.
    Newly slow: passed in both and a metric significantly worse (the rule of `matrix compare`); with fewer
    than two passed attempts a side it is 'insufficient data', never unchanged. Not run: a result in A,
    none (or only a skip or an interruption) in B. Exit code: 0; 1 when a category --fail-on names has
    cells (by default: new failures); 2 bad input (an unknown campaign).
    """
    from matrix.output import print_json
    from matrix.report.diff import diff_campaigns, resolve_campaign
    from matrix.report.perf import check_thresholds

    check_thresholds(threshold, alpha)
    a, b = resolve_campaign(session, campaign_a), resolve_campaign(session, campaign_b)
    result = diff_campaigns(session, a, b, threshold, alpha)
    failing = result.failing(fail_on)
    if as_json:
        print_json({**result.as_dict(), "fail_on": fail_on, "failing": failing})
    else:
        click.echo("\n".join(result.lines()))
        if failing:
            click.echo(f"--fail-on {fail_on}: " + ", ".join(f"{result.cells(c)} {c}" for c in failing))
    if failing:
        raise SystemExit(1)


def register(cli: click.Group) -> None:
    cli.add_command(diff_cmd)
