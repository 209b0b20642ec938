"""CI fan-out commands: `matrix import`, and the helpers `plan --format github-matrix` and
`run --results-out` call. Thin, like every `matrix.cli` module; the logic lives in `matrix.fanout.shards`,
`matrix.fanout.shard_results` and `matrix.fanout.shard_import`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click

from matrix.cli.app import with_session
from matrix.cli.quarantine import auto_quarantine_options, record_quarantines

if TYPE_CHECKING:
    from sqlalchemy.orm import Session, sessionmaker

    from matrix.plan import Plan

__all__ = ["check_results_path", "print_github_matrix", "register", "write_results_file"]


def print_github_matrix(session: Session, plan: Plan, max_jobs: int) -> None:
    """One line of compact JSON on stdout (for `$GITHUB_OUTPUT`); the summary goes to stderr."""
    from matrix.campaign import expected_durations
    from matrix.fanout.shards import expected_seconds, github_matrix, shard_cells

    history = expected_durations(session)
    expected = {cell.key: expected_seconds(cell, history) for cell in plan.cells}
    shards = shard_cells(plan.cells, expected, max_jobs)
    click.echo(json.dumps(github_matrix(shards), separators=(",", ":")))
    if not shards:
        click.echo(
            'note: the selection matches no cells, so the matrix is {"include": []}; GitHub rejects an empty '
            "matrix, so guard the shard job with `if: fromJSON(needs.<plan job>.outputs.matrix).include[0]`",
            err=True,
        )
        return
    loads = [shard.expected_s for shard in shards]
    mean = sum(loads) / len(loads)
    click.echo(
        f"{len(plan.cells)} cells in {len(shards)} shards (max {max_jobs}); expected seconds per shard: "
        f"max {max(loads):.0f}, mean {mean:.0f} (max/mean {max(loads) / mean:.2f})",
        err=True,
    )


def check_results_path(path: Path) -> None:
    """Fail before the run, not after an hour of cells, when the results file cannot be written."""
    import os

    from matrix.errors import ConfigError

    directory = path.parent
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--results-out {path}: cannot create {directory} ({exc.strerror})") from None
    if path.is_dir() or not os.access(directory, os.W_OK):
        raise ConfigError(f"--results-out {path}: not a writable file path; give a file in a writable directory")


def write_results_file(
    factory: sessionmaker[Session], campaign_ids: list[int], path: Path, key: str, *, err: bool
) -> None:
    from matrix.db.engine import transaction
    from matrix.fanout.shard_results import write_results

    if not campaign_ids:
        click.echo(f"no campaign ran, so no results file was written to {path}", err=True)
        return
    with transaction(factory) as session:
        count = write_results(session, campaign_ids[-1], path, key)
    click.echo(f"results: {path} ({count} attempts, campaign key {key})", err=err)


@click.command("import")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path, dir_okay=False))
@click.option("--logs-dir", type=click.Path(path_type=Path),
              help="Where the carried log tails go (default: data dir/runs).")  # fmt: skip
@auto_quarantine_options
@with_session
def import_cmd(
    session: Session, files: tuple[Path, ...], logs_dir: Path | None, auto_quarantine: bool,
    quarantine_window_days: int, quarantine_clean_runs: int,
) -> None:  # fmt: skip
    """Merge shard results FILES (from `matrix run --results-out`) into this database.

    Shards with one campaign key go into one campaign (created here if needed); each attempt is
    matched by its id, so importing a file twice changes nothing. Every file is checked first (format,
    fields, and that this catalog has their cases and runtimes); any problem writes nothing.
    """
    from matrix.fanout.shard_import import import_results
    from matrix.fanout.shard_results import read_results
    from matrix.paths import runs_dir

    parsed = [read_results(path) for path in files]
    summaries = import_results(session, parsed, logs_dir or runs_dir())
    for s in summaries:
        what = "new campaign" if s.created else "campaign"
        renumbered = f" ({s.renumbered} renumbered after attempts already there)" if s.renumbered else ""
        click.echo(
            f"{what} {s.id} (key {s.key}): {s.imported} attempts imported{renumbered}, "
            f"{s.present} already present, {s.updated} updated"
        )
        for warning in s.warnings:
            click.echo(f"warning: {warning}", err=True)
    total = sum(s.imported for s in summaries)
    present = sum(s.present for s in summaries)
    click.echo(f"{len(files)} file(s): {total} attempts imported, {present} already present")
    # Shards ran on hosts of their own: the flake evidence and the clean runs meet in this database.
    for line in record_quarantines(session, [s.id for s in summaries], auto_quarantine, quarantine_window_days,
                                   quarantine_clean_runs):  # fmt: skip
        click.echo(line)


def register(cli: click.Group) -> None:
    """Add `import` to the `matrix` group."""
    cli.add_command(import_cmd)
