"""Hand edits of the catalog from the command line (`matrix runtime add`, `matrix marker add`...)."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Backend, Marker, Runtime, RuntimeComponent
from matrix.errors import ConfigError
from matrix.versions import parse_version, tag_for


def _backend(session: Session, name: str) -> Backend:
    backend = session.scalar(select(Backend).where(Backend.name == name, Backend.retired.is_(False)))
    if backend is None:
        known = ", ".join(session.scalars(select(Backend.name).where(Backend.retired.is_(False)))) or "none"
        raise ConfigError(f"unknown backend {name!r}; known backends: {known} (add it to data/backends.toml)")
    return backend


def find_runtime(session: Session, backend: str, version: str) -> Runtime:
    wanted = parse_version(version)
    row = next(
        (
            r
            for r in _backend(session, backend).runtimes
            if parse_version(r.version) == wanted and not r.retired
        ),
        None,
    )
    if row is None:
        raise ConfigError(f"unknown runtime {backend} {version}; see `matrix runtimes list`")
    return row


def add_runtime(
    session: Session,
    backend: str,
    version: str,
    tag: str | None,
    channel: str | None,
    components: Sequence[str],
    provider: str,
    notes: str,
) -> Runtime:
    row_backend = _backend(session, backend)
    parsed = parse_version(version)
    if any(parse_version(r.version) == parsed for r in row_backend.runtimes):
        raise ConfigError(f"runtime {backend} {parsed} already exists; see `matrix runtimes list`")
    parsed_components = {}
    for text in components:
        name, sep, value = text.partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"invalid --component {text!r}: write NAME=VERSION, e.g. vllm-rs=0.30.0")
        parsed_components[name] = str(parse_version(value))
    if channel is None:
        channel = "dev" if parsed.is_devrelease else "rc" if parsed.is_prerelease else "release"
    row = Runtime(
        backend=row_backend,
        version=str(parsed),
        tag=tag or tag_for(parsed),
        channel=channel,
        provider={"kind": provider},
        notes=notes,
        source="cli",
        enabled=True,
        retired=False,
        components=[RuntimeComponent(name=n, version=v) for n, v in sorted(parsed_components.items())],
    )
    session.add(row)
    session.flush()
    return row


def set_runtime_enabled(session: Session, backend: str, version: str, enabled: bool) -> Runtime:
    row = find_runtime(session, backend, version)
    row.enabled = enabled
    return row


def add_marker(session: Session, name: str, kind: str, description: str, parametrised: bool) -> Marker:
    if not name.isidentifier():
        raise ConfigError(f"invalid marker name {name!r}: use letters, digits and underscores")
    if session.scalar(select(Marker).where(Marker.name == name)) is not None:
        raise ConfigError(f"marker {name!r} already exists; see `matrix markers list`")
    row = Marker(
        name=name, kind=kind, description=description, parametrised=parametrised, source="cli", retired=False
    )
    session.add(row)
    session.flush()
    return row
