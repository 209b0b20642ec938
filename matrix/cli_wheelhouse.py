"""`matrix runtime wheelhouse`: lock and download what the selected venv runtimes install on a target host, so
that host (often air-gapped) builds them with `matrix runtime provision --find-links DIR --offline`."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import click

from matrix.cli_runtime import CatalogView, _with_catalog, runtime_selection_options, select_runtimes
from matrix.errors import ConfigError

if TYPE_CHECKING:
    from matrix.plan import RuntimeInfo


def _check_named_are_venv(runtimes: Sequence[RuntimeInfo], known_backends: set[str], wanted: Sequence[str]) -> None:
    """A runtime named with --runtime that has no venv recipe cannot be locked: say so instead of skipping it."""
    from matrix.plan import _runtime_selector

    named = {_runtime_selector(text, known_backends) for text in wanted}
    for runtime in runtimes:
        kind = runtime.provider.get("kind", "host")
        if (runtime.backend, runtime.parsed_version) in named and kind != "venv":
            raise ConfigError(
                f"runtime {runtime.label} is a {kind} runtime: only venv runtimes have a recipe to put into a "
                "wheelhouse (see `matrix runtimes list`)"
            )


def _split_names(values: Sequence[str]) -> list[str]:
    return [name.strip() for value in values for name in value.split(",") if name.strip()]


@click.command("wheelhouse")
@runtime_selection_options
@click.option("--python", "python", metavar="X.Y", help="The target's Python (default: this interpreter's).")
@click.option("--platform", "platforms", multiple=True, metavar="TAG",
              help="The target's wheel platform tag, e.g. manylinux_2_39_x86_64 (older compatible tags are "
              "included); repeatable. Default: this host's.")  # fmt: skip
@click.option("--out", "out", type=click.Path(path_type=Path, file_okay=False), required=True, metavar="DIR",
              help="The wheelhouse directory (created; an existing one gets these runtimes added).")  # fmt: skip
@click.option("--exclude", multiple=True, metavar="NAME[,NAME...]",
              help="Distributions the target host already has (e.g. nvidia-cublas): recorded as provided by the "
              "host, not downloaded. Repeatable.")  # fmt: skip
@click.option("--omit", multiple=True, metavar="NAME[,NAME...]",
              help="Distributions the runtime never imports on the target (e.g. a video codec a text model never "
              "loads), left out to fit a transfer budget: neither downloaded nor installed; a cell that does "
              "import one fails with its ImportError. Repeatable.")  # fmt: skip
@_with_catalog
def wheelhouse_cmd(
    view: CatalogView,
    wanted: tuple[str, ...],
    backends: tuple[str, ...],
    since: tuple[str, ...],
    until: tuple[str, ...],
    python: str | None,
    platforms: tuple[str, ...],
    out: Path,
    exclude: tuple[str, ...],
    omit: tuple[str, ...],
) -> None:
    """Download the exact wheels each selected venv runtime installs on a target host into DIR, with a
    manifest (DIR/wheelhouse.json) locking them step by step.

    Resolution is for the target (--python, --platform), not this host. Progress goes to stderr. Build on the
    target with `matrix runtime provision --find-links DIR --offline` (or `matrix run ... --offline`).
    """
    from matrix.launch.providers.wheelhouse import Manifest, read_manifest, write_manifest
    from matrix.launch.providers.wheelresolve import check_writable, download, lock_of, plan_runtime
    from matrix.launch.providers.wheeltarget import WheelTarget, this_host

    _cases, runtimes, _markers, known_backends = view
    host = this_host() if python is None or not platforms else None
    target = WheelTarget.of(python or (host.python if host else ""), platforms or (host.platforms if host else ()))
    _check_named_are_venv(runtimes, known_backends, wanted)
    chosen = select_runtimes(runtimes, known_backends, wanted=wanted, backends=backends, since=since, until=until)
    if not chosen:
        venvs = ", ".join(r.label for r in runtimes if r.provider.get("kind") == "venv") or "none"
        raise ConfigError(f"no venv runtime in the selection (venv runtimes of the catalog: {venvs})")
    out = out.expanduser().resolve()
    check_writable(out)
    created = datetime.now(UTC).isoformat(timespec="seconds")
    fresh = Manifest(target.python, target.platforms, target.key_platform, created)
    existing = read_manifest(out)
    if existing is not None:
        existing.merged(fresh)  # refuses another target before anything is resolved or downloaded

    def say(line: str) -> None:
        click.echo(line, err=True)

    say(f"wheelhouse for {target.describe()} ({len(target.tags)} platform tags) in {out}")
    excluded = _split_names(exclude)
    omitted = _split_names(omit)
    planned = [plan_runtime(runtime, target, excluded, say, omitted) for runtime in chosen]
    files = download([f for p in planned for s in p.steps for f in s.downloads()], out, say)
    locks = {p.label: lock_of(p, files) for p in planned}
    manifest = Manifest(target.python, target.platforms, target.key_platform, created, locks)
    if existing is not None:
        manifest = existing.merged(manifest)
    path = write_manifest(out, manifest)
    for lock in locks.values():
        provided = f"; provided by the host: {', '.join(lock.excluded)}" if lock.excluded else ""
        provided += f"; omitted: {', '.join(lock.omitted)}" if lock.omitted else ""
        count = len({f.filename for f in lock.files()})
        click.echo(f"{lock.label}: {count} file(s) locked for recipe key {lock.key[:20]}{provided}")
    click.echo(f"wrote {path} ({len(manifest.runtimes)} runtime(s)); on the target: "
               f"`matrix runtime provision --find-links {out} --offline`")  # fmt: skip
