"""The `matrix` command line: `app` holds the group and what commands share; each sibling module is one
command group and adds its commands with `register(cli)`. Only this module imports them all, so no command
module imports another's registration and none imports this one.
"""

from __future__ import annotations

import gc
import sys

from matrix.cli import (
    catalog,
    db,
    detection,
    diff,
    evidence,
    fanout,
    images,
    quarantine,
    report,
    run,
    runtime,
    skew,
    versions,
)
from matrix.cli.app import cli, pause_gc

__all__ = ["cli", "main"]

_COMMANDS = (db, catalog, runtime, images, run, report, diff, skew, versions, fanout, quarantine, evidence, detection)
for _module in _COMMANDS:
    _module.register(cli)


def main() -> None:
    # A command's start-up makes tens of thousands of objects (SQLAlchemy's, the models) that live until
    # exit. The cyclic GC would walk them over and over while they are made, and once more while the
    # interpreter shuts down: a quarter of `matrix plan`'s time on a 2-core host. So it is paused until
    # the database is open (`App.engine` resumes it), and what is left at exit goes to the OS unwalked
    # (the database was closed when the command's context closed).
    pause_gc()
    # `import httpx` also imports httpx's own command line (Rich, Pygments), unless that import fails, which
    # httpx allows for: no matrix command uses it, and it is a tenth of a one-cell `matrix run`'s start-up.
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    try:
        cli(prog_name="matrix")
    finally:
        gc.freeze()
