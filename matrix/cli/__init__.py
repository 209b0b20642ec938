"""The `matrix` command line: `app` holds the group and what commands share; each sibling module is one
command group and adds its commands with `register(cli)`. Only this module imports them all, so no command
module imports another's registration and none imports this one.
"""

from __future__ import annotations

from matrix.cli import catalog, db, fanout, report, run, runtime, versions
from matrix.cli.app import cli

__all__ = ["cli", "main"]

for _module in (db, catalog, runtime, run, report, versions, fanout):
    _module.register(cli)


def main() -> None:
    cli(prog_name="matrix")
