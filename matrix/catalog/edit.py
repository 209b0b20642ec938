"""Hand edits of the catalog from the command line (`matrix runtime add`, `matrix marker add`...)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

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
    pip: Sequence[str] = (),
    python: str | None = None,
) -> Runtime:
    row_backend = _backend(session, backend)
    parsed = parse_version(version)
    provider_entry = _provider_entry(f"runtime {backend} {parsed}", provider, pip, python)
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
        provider=provider_entry,
        notes=notes,
        source="cli",
        enabled=True,
        retired=False,
        components=[RuntimeComponent(name=n, version=v) for n, v in sorted(parsed_components.items())],
    )
    session.add(row)
    session.flush()
    return row


def put_runtime(
    session: Session,
    *,
    backend: str,
    version: str,
    channel: str,
    provider: dict[str, Any],
    components: dict[str, str],
    notes: str,
) -> Runtime:
    """Add a runtime made by a command (`matrix runtime image`), or replace the provider, components and
    notes of the one it made before. A catalog runtime of that version is never overwritten."""
    from matrix.launch.providers.recipe import check_provider

    row_backend = _backend(session, backend)
    parsed = parse_version(version)
    check_provider(provider, f"{backend}-{parsed}")
    row = next((r for r in row_backend.runtimes if parse_version(r.version) == parsed), None)
    if row is not None and row.source != "cli":
        raise ConfigError(f"runtime {backend} {parsed} comes from the catalog files: pick another version")
    if row is None:
        row = Runtime(backend=row_backend, version=str(parsed), tag=tag_for(parsed), source="cli")
        session.add(row)
    row.channel, row.provider, row.notes, row.enabled, row.retired = channel, provider, notes, True, False
    if row.components:
        row.components.clear()
        session.flush()  # the old rows go before the new ones, which have the same (runtime, name) keys
    row.components = [RuntimeComponent(name=n, version=v) for n, v in sorted(components.items())]
    session.flush()
    return row


def _provider_entry(label: str, kind: str, pip: Sequence[str], python: str | None) -> dict[str, Any]:
    """The provider table `runtime add` stores: for `venv`, one pip step per --pip (checked like the catalog's)."""
    if kind != "venv":
        if pip or python:
            raise ConfigError("--pip and --python describe a venv runtime: add --provider venv")
        return {"kind": kind}
    if not pip:
        raise ConfigError(
            "a venv runtime needs its install steps: --pip 'PKG==VERSION' (repeatable, one `pip install` each)"
        )
    entry: dict[str, Any] = {"kind": "venv", "steps": [shlex.split(step) for step in pip]}
    if python:
        entry["python"] = python
    from matrix.launch.providers.recipe import parse_venv

    parse_venv(entry, label)  # the catalog's own checks: an empty step, an unknown key...
    return entry


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
