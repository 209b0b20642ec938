"""Commands about runtime environments: `matrix runtime provision|envs|prune` and `matrix doctor`
(`matrix runtime wheelhouse` is in `matrix.cli_wheelhouse`).

`matrix.cli` calls `register(cli)` once its own commands exist. This module does not import `matrix.cli`
at module level, so either module may be imported first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from matrix.errors import ConfigError, MatrixError

if TYPE_CHECKING:
    from matrix.cli import App
    from matrix.launch.providers.wheelhouse import ProvisionSource
    from matrix.plan import CaseInfo, RuntimeInfo

CatalogView = tuple[list["CaseInfo"], list["RuntimeInfo"], set[str], set[str]]


def _catalog(app: App) -> CatalogView:
    """Cases, runtimes, marker and backend names, read in one short transaction (detached dataclasses,
    so no database transaction stays open during a long build)."""
    from matrix.db.engine import transaction
    from matrix.plan import load_catalog_view

    with transaction(app.sessions()) as session:
        return load_catalog_view(session)


def _json_option(func: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")(func)


def _with_catalog(func: Callable[..., Any]) -> Callable[..., Any]:
    """Pass the catalog view instead of the App (the pattern of matrix.cli's `with_session`)."""

    @functools.wraps(func)
    @click.pass_obj
    def wrapper(app: App, *args: Any, **kwargs: Any) -> Any:
        return func(_catalog(app), *args, **kwargs)

    return wrapper


def _size(value: int) -> str:
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.0f} MiB"


def select_runtimes(
    runtimes: Sequence[RuntimeInfo],
    known_backends: set[str],
    *,
    wanted: Sequence[str] = (),
    backends: Sequence[str] = (),
    since: Sequence[str] = (),
    until: Sequence[str] = (),
) -> list[RuntimeInfo]:
    """The venv runtimes a `provision` selection names, with the spellings `matrix plan` accepts.

    Disabled runtimes are left out unless named with --runtime.
    """
    from matrix.plan import _runtime_selector
    from matrix.versions import VersionWindow, parse_bound

    for backend in backends:
        if backend not in known_backends:
            raise ConfigError(f"unknown backend {backend!r} (known: {', '.join(sorted(known_backends))})")
    window = VersionWindow(since=tuple(parse_bound(s) for s in since), until=tuple(parse_bound(u) for u in until))
    named = {_runtime_selector(text, known_backends) for text in wanted}
    present = {(r.backend, r.parsed_version) for r in runtimes}
    for backend, version in sorted(named - present):
        raise ConfigError(f"unknown runtime {backend}={version}; see `matrix runtimes list`")
    chosen = []
    for runtime in sorted(runtimes, key=lambda r: (r.backend, r.parsed_version)):
        if runtime.provider.get("kind") != "venv":
            continue
        if named and (runtime.backend, runtime.parsed_version) not in named:
            continue
        if backends and runtime.backend not in backends:
            continue
        if not window.admits(runtime.backend, runtime.parsed_version)[0]:
            continue
        if not runtime.enabled and not named:
            continue
        chosen.append(runtime)
    return chosen


def runtime_selection_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--runtime, --backend, --since, --until: which venv runtimes (see `select_runtimes`)."""
    options = [
        click.option(
            "--runtime", "wanted", multiple=True, metavar="BACKEND=V", help="Only these runtimes; repeatable."
        ),
        click.option("--backend", "backends", multiple=True, metavar="NAME", help="Only runtimes of these backends."),
        click.option("--since", multiple=True, metavar="V|BACKEND=V", help="Oldest version (inclusive); repeatable."),
        click.option("--until", multiple=True, metavar="V|BACKEND=V", help="Newest version (inclusive); repeatable."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


def source_options(func: Callable[..., Any]) -> Callable[..., Any]:
    """--find-links DIR and --offline: where provisioning takes packages from."""
    func = click.option(
        "--offline", is_flag=True,
        help="Build venv runtimes from the wheelhouse given with --find-links only (no index; its exact files).",
    )(func)  # fmt: skip
    return click.option(
        "--find-links", type=click.Path(path_type=Path), metavar="DIR",
        help="A wheelhouse (`matrix runtime wheelhouse --out DIR`): pip also looks there; with --offline only there.",
    )(func)  # fmt: skip


def provision_source(find_links: Path | None, offline: bool) -> ProvisionSource:
    """The checked --find-links/--offline options (`ConfigError`, exit 2, before anything is built)."""
    from matrix.launch.providers.wheelhouse import ProvisionSource

    return ProvisionSource.of(find_links, offline)


@click.command("provision")
@runtime_selection_options
@source_options
@_with_catalog
def provision_cmd(
    view: CatalogView,
    wanted: tuple[str, ...],
    backends: tuple[str, ...],
    since: tuple[str, ...],
    until: tuple[str, ...],
    find_links: Path | None,
    offline: bool,
) -> None:
    """Build the virtual environments of the selected venv runtimes (all enabled ones by default).

    Each recipe is built once in the data directory (envs/) and shared by every runner; a second runner
    waits for a build in progress and reuses it. With --offline each is built from the wheelhouse --find-links
    names, from exactly the files its manifest locks. Exit code 1 when any environment could not be built, 2
    when the input was wrong (among them a wheelhouse lacking a runtime or a file).
    """
    from matrix.interrupts import StopSignal
    from matrix.launch.providers.buildprocs import BuildInterrupted
    from matrix.launch.providers.venv import provision_target

    _cases, runtimes, _markers, known_backends = view
    source = provision_source(find_links, offline)
    chosen = select_runtimes(runtimes, known_backends, wanted=wanted, backends=backends, since=since, until=until)
    if not chosen:
        venvs = ", ".join(r.label for r in runtimes if r.provider.get("kind") == "venv") or "none"
        click.echo(f"no venv runtime in the selection (venv runtimes of the catalog: {venvs})")
        return
    failed = []
    config_errors = 0
    # SIGINT/SIGTERM end the build in progress (its processes and half-built directory) and exit 3.
    stop = StopSignal()
    stop.install()
    try:
        for runtime in chosen:
            try:
                result = provision_target(runtime, echo=click.echo, source=source, stop=lambda: stop.requested)
            except MatrixError as exc:  # a bad recipe or a failed build: report it and go on with the others
                failed.append(runtime.label)
                config_errors += isinstance(exc, ConfigError)
                click.secho(str(exc), err=True, fg="red")  # the message names the runtime
                continue
            how = "built" if result.built else ("built by another runner" if result.waited else "already provisioned")
            click.echo(f"{runtime.label}: {how}: {result.path}")
    except BuildInterrupted:
        click.secho(f"interrupted by {stop.signal_name or 'a signal'}: the build in progress was removed", err=True)
        raise SystemExit(3) from None
    finally:
        stop.restore()
    click.echo(f"{len(chosen) - len(failed)} of {len(chosen)} runtime(s) provisioned")
    if failed:
        raise SystemExit(2 if config_errors else 1)


@click.command("envs")
@_json_option
@_with_catalog
def envs_cmd(view: CatalogView, as_json: bool) -> None:
    """List provisioned environments: state, Python, the runtimes using them, size, creation time, recipe."""
    from matrix.launch.providers.store import list_envs
    from matrix.launch.providers.venv import envs_dir, resolve_target
    from matrix.output import print_json, print_table

    users: dict[str, list[str]] = {}
    for runtime in view[1]:
        if runtime.provider.get("kind") != "venv":
            continue
        try:
            users.setdefault(resolve_target(runtime).name, []).append(runtime.label)
        except MatrixError:  # a runtime whose recipe or interpreter is broken uses no environment
            continue
    entries = list_envs()
    rows = [
        {
            "name": e.name,
            "state": e.state,
            "python": e.info.get("python_version", ""),
            "runtimes": sorted(users.get(e.name, [])),
            "size_bytes": e.size_bytes,
            "created": e.info.get("created", ""),
            "recipe": e.info.get("recipe", {}).get("summary", "") if isinstance(e.info.get("recipe"), dict) else "",
            "path": str(e.path),
        }
        for e in entries
    ]
    if as_json:
        print_json(rows)
        return
    if not rows:
        click.echo(f"no environments in {envs_dir()} (build them with `matrix runtime provision`)")
        return
    print_table(
        ("env", "state", "python", "runtimes", "size", "created", "recipe"),
        [
            (r["name"], r["state"], r["python"], ", ".join(r["runtimes"]) or "(unused)",
             _size(r["size_bytes"]) if r["size_bytes"] else "", r["created"], r["recipe"])
            for r in rows
        ],
    )  # fmt: skip


@click.command("prune")
@click.option("--dry-run", is_flag=True, help="Show what would be removed; remove nothing.")
@_with_catalog
def prune_cmd(view: CatalogView, dry_run: bool) -> None:
    """Remove environments no runtime of this database's catalog uses, and leftovers of builds that died.

    Environments being built (their lock is held) are left alone.
    """
    from matrix.launch.providers.store import prune, referenced_names

    report = prune(referenced_names(view[1]), dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for removal in report.removed:
        click.echo(f"{verb} {removal.path} ({removal.why}, {_size(removal.size_bytes)})")
    for name in report.busy:
        click.echo(f"left {name}: a build holds its lock")
    click.echo(
        f"{verb} {len(report.removed)} item(s), {_size(report.freed_bytes)}; kept {len(report.kept)} environment(s) "
        "in use"
    )


@click.command("doctor")
@_json_option
@_with_catalog
def doctor_cmd(view: CatalogView, as_json: bool) -> None:
    """Show what this host can run: GPUs, driver, container engines, /dev/shm, uv, disk; and for each runtime
    of the catalog whether its cells run here, and why not."""
    from matrix.doctor import doctor, host_lines
    from matrix.output import print_json, print_table

    cases, runtimes, markers, backends = view
    report = doctor(cases, runtimes, known_markers=markers, known_backends=backends)
    if as_json:
        print_json(report.as_dict())
        return
    print_table(("host", ""), host_lines(report.host))
    if not report.runtimes:
        click.echo("the catalog has no runtimes: run `matrix catalog sync`")
        return
    print_table(
        ("runtime", "provider", "status", "runnable", "cells", "why not"),
        [
            (r.runtime, r.provider, r.status, r.runnable, f"{r.runnable_cells}/{r.cells}", _brief(r.reasons))
            for r in report.runtimes
        ],
    )


def _brief(reasons: Sequence[str]) -> str:
    """Reasons on one line for the table: a multi-line one (a build's log tail) keeps its first and last
    lines; `--json` has them whole."""
    short = []
    for reason in reasons:
        lines = [line for line in reason.splitlines() if line.strip()]
        short.append(lines[0] if len(lines) < 2 else f"{lines[0]} [...] {lines[-1]}")
    return "; ".join(short)


def register(cli: click.Group) -> None:
    """Add `runtime provision|envs|prune|wheelhouse` to the `runtime` group of `cli` (made if absent) and `doctor`."""
    from matrix.cli import MatrixGroup

    group = cli.commands.get("runtime")
    if not isinstance(group, click.Group):
        group = MatrixGroup("runtime", help="Runtime versions and their environments.")
        cli.add_command(group)
    from matrix.cli_wheelhouse import wheelhouse_cmd

    for command in (provision_cmd, envs_cmd, prune_cmd, wheelhouse_cmd):
        group.add_command(command)
    cli.add_command(doctor_cmd)
