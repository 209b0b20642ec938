"""Version intelligence commands: `matrix discover` (new releases on the index) and `matrix bisect`.

`matrix.cli` calls `register(cli)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from matrix.cli.app import json_option

if TYPE_CHECKING:
    from matrix.cli.app import App


def _display_url(url: str) -> str:
    """An index URL without its credentials (mirrors often carry user:token@)."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError):
        return url
    return str(parsed.copy_with(username=None, password=None)) if parsed.userinfo else url


@click.command("discover")
@click.argument("backend")
@click.option("--package", metavar="NAME", help="The package on the index (default: the template's `package`).")
@click.option("--dry-run", is_flag=True, help="List what would be added; change nothing.")
@click.option("--channel", type=click.Choice(["release", "rc", "dev"]), default="release", show_default=True,
              help="release: final versions; rc: also pre-releases; dev: also dev releases.")
@click.option("--index-url", metavar="URL",
              help="A PEP 691 simple index (default: $PIP_INDEX_URL, pip's configuration, else PyPI).")
@click.option("--no-resolve", is_flag=True,
              help="Do not resolve each new release's requirements with uv first (e.g. on an index that lacks "
                   "what the target host provides, such as a wheelhouse made with --exclude).")
@json_option
@click.pass_obj
def discover_cmd(
    app: App, backend: str, package: str | None, dry_run: bool, channel: str, index_url: str | None,
    no_resolve: bool, as_json: bool,
) -> None:
    """Add the versions on the package index newer than the catalog's as runtimes (from the backend's
    runtime_template). Versions that are yanked, refuse the template's Python, have no file pip could install
    on this host, or whose requirements do not resolve for the runtime's target (uv) are skipped and listed
    with why. `matrix run --new` then runs them."""
    from matrix.db.engine import transaction
    from matrix.discover import discover
    from matrix.output import print_json, print_table
    from matrix.text import clean

    with transaction(app.sessions()) as session:
        result = discover(session, backend, package=package, index_url=index_url, channel=channel, dry_run=dry_run,
                          resolve=not no_resolve)
        if dry_run:
            session.rollback()
    result.index_url = _display_url(result.index_url)
    if as_json:
        print_json(result.as_dict())
        return
    click.echo(f"{result.package} on {result.index_url}: newest in the catalog {result.newest_known or 'none'}")
    rows = []
    for item in result.found:
        if item.action == "yanked":
            rows.append((item.version, item.files, f"yanked, skipped{': ' + item.yanked if item.yanked else ''}"))
        elif item.action == "python":
            refused = ", ".join(sorted(set(item.requires_python)))
            why = f"skipped: Requires-Python {refused} excludes the template's interpreter"
            rows.append((item.version, item.files, why))
        elif item.action == "platform" and result.target is not None:
            kinds = ", ".join(sorted(set(item.wheels)))
            why = f"skipped: no sdist and no wheel pip could install into {result.target.describe()} (wheels: {kinds})"
            rows.append((item.version, item.files, why))
        elif item.action == "unresolvable":
            why = f"unresolvable, skipped: no index has {', '.join(item.missing)} (uv's resolver)"
            rows.append((item.version, item.files, why))
        elif item.action in ("added", "would add"):
            rows.append((item.version, item.files, item.action))
    if rows:
        print_table(("version", "files", "action"), rows)
    for entry in result.malformed:
        click.echo(f"skipped malformed file entry (no version in its name): {clean(entry)}")
    added = sum(1 for f in result.found if f.action == "added")
    if dry_run:
        click.echo(f"dry run: {sum(1 for f in result.found if f.action == 'would add')} version(s) would be added")
    elif added:
        click.echo(f"{added} runtime(s) added; `matrix run --new` runs their cells")
    else:
        click.echo("no new version")


@click.command("bisect")
@click.argument("case")
@click.option("--between", nargs=2, required=True, metavar="GOOD BAD",
              help="A version where the case passes and one where it fails (either order in time).")
@click.option("--backend", metavar="NAME", help="The backend whose runtimes to walk (default: the case's).")
@click.option("--repeat", type=int, default=1, show_default=True,
              help="Attempts per probed version, for flaky failures: any failure makes a version bad.")
@click.option("--flaky", type=float, metavar="RATE",
              help="Probabilistic bisection of a flaky break: a bad version fails this share of its attempts.")
@click.option("--confidence", type=float, default=0.95, show_default=True,
              help="With --flaky: stop once one version is the first bad one with this probability.")
@click.option("--max-cells", type=int, default=100, show_default=True, help="With --flaky: give up after N attempts.")
@click.option("--component", metavar="NAME",
              help="Bisect a dependency instead: GOOD and BAD are NAME's versions, each installed into the case's "
                   "newest runtime (or --on's) by replacing the recipe's NAME pin.")
@click.option("--on", metavar="VERSION", help="With --component: the engine runtime to keep fixed.")
@click.option("--from-index", is_flag=True,
              help="First add the index's releases between GOOD and BAD that the catalog lacks, as runtimes "
                   "from the backend's runtime_template (as `matrix discover` does).")
@click.option("--index-url", metavar="URL",
              help="With --from-index or --component: a PEP 691 simple index (default as for discover).")
@click.option("--logs-dir", type=click.Path(path_type=Path), help="Where cell logs go (default: data dir/runs).")
@json_option
@click.pass_obj
def bisect_cmd(
    app: App, case: str, between: tuple[str, str], backend: str | None, repeat: int, flaky: float | None,
    confidence: float, max_cells: int, component: str | None, on: str | None, from_index: bool,
    index_url: str | None, logs_dir: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """Find the first version between GOOD and BAD at which CASE changes outcome.

    Each probe is a normal attempt of one bisect campaign (`matrix show`, `matrix report` see it). Ctrl-C
    stops it; the same command continues from the recorded attempts. Exit 0 when a boundary was found,
    1 when there was nothing to bisect, 2 on bad input, 3 when interrupted.
    """
    from matrix.bisect import BisectInterrupted, bisect, stdout_to_stderr
    from matrix.output import print_json, print_table
    from matrix.paths import usable_dir
    from matrix.text import clean

    if logs_dir is not None:
        usable_dir(logs_dir, "--logs-dir")
    if index_url and not (from_index or component):
        raise click.UsageError("--index-url is read only with --from-index or --component")

    def say(line: str) -> None:
        click.echo(clean(line), err=as_json)

    run_options: dict[str, Any] = {"logs_dir": logs_dir}
    try:
        with stdout_to_stderr(as_json):
            result = bisect(app.sessions(), case, between[0], between[1], backend=backend, repeat=repeat,
                            echo=say, run_options=run_options, flaky=flaky, confidence=confidence,
                            cell_limit=max_cells, from_index=from_index, index_url=index_url, component=component,
                            on=on)  # fmt: skip
    except (BisectInterrupted, KeyboardInterrupt) as exc:
        which = f"campaign {exc.campaign_id} " if isinstance(exc, BisectInterrupted) else ""
        click.echo(f"bisect {which}interrupted: run the same command again to continue from its recorded attempts",
                   err=True)  # fmt: skip
        raise SystemExit(3) from None
    if as_json:
        print_json(result.as_dict())
    else:
        rows = [(p.version, p.verdict, " ".join(p.statuses), clean(next((m for m in p.messages if m), p.skipped)))
                for p in result.probes]  # fmt: skip
        print_table(("version", "verdict", "attempts", "evidence"), rows, title=f"bisect campaign {result.campaign_id}")
        if result.first is not None:
            click.echo(f"{result.direction} version: {result.first} (previous: {result.last_other}); "
                       f"{sum(len(p.statuses) for p in result.probes)} cell(s) over {len(result.versions)} versions")
        if result.unsure:
            click.echo(f"unsure: {', '.join(result.unsure)}")
        if result.note:
            click.echo(result.note)
    raise SystemExit(0 if result.first is not None else 1)


def register(cli: click.Group) -> None:
    cli.add_command(discover_cmd)
    cli.add_command(bisect_cmd)
