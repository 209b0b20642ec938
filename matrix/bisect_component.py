"""`matrix bisect --component NAME`: a dependency's released versions under one fixed engine runtime.

Each version V of the component becomes a *variant* of the base runtime: the same recipe with the
component's pin replaced by `NAME==V` (and companions pinned in lockstep, such as `nixl-cu13` beside
`nixl`), stored as a runtime of the same backend with `source = "derived"` and the version
`BASE+NAME.V` (a PEP 440 local label, so it sorts and prints like any version). Derived runtimes enter a
plan only when named with `--runtime`, so `matrix run` never picks them up by itself; the bisect names them.
"""

from __future__ import annotations

import re

from packaging.utils import canonicalize_name
from packaging.version import Version
from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.db.models import Runtime, RuntimeComponent
from matrix.discover import default_index_url, fetch_project, versions_on_index
from matrix.errors import ConfigError
from matrix.versions import parse_version, tag_for

DERIVED = "derived"


def variant_version(base: str, component: str, version: str) -> str:
    """`0.32.0` + nixl 1.4.0 -> `0.32.0+nixl.1.4.0` (a local label; appended to one the base already has)."""
    label = re.sub(r"[^a-z0-9]+", ".", f"{canonicalize_name(component)}.{version}".lower())
    return str(parse_version(f"{base}{'.' if '+' in base else '+'}{label}"))


def index_versions(component: str, good: str, bad: str, index_url: str | None) -> tuple[list[Version], list[str]]:
    """The component's final, unyanked releases from GOOD to BAD on the index, and what was left out."""
    lo, hi = sorted((parse_version(good), parse_version(bad)))
    found, _ = versions_on_index(fetch_project(index_url or default_index_url(), component))
    keep, left_out = [], []
    for version in sorted(found):
        if not lo <= version <= hi or version.is_prerelease or version.is_devrelease:
            continue
        if found[version].yanked is not None:
            left_out.append(f"{version} (yanked)")
        else:
            keep.append(version)
    for end, name in ((parse_version(good), "GOOD"), (parse_version(bad), "BAD")):
        if end not in keep:
            raise ConfigError(
                f"--between: {name} {end} is not a release of {component} on the index; "
                f"releases in range: {', '.join(str(v) for v in keep) or 'none'}"
            )
    return keep, left_out


def make_variants(session: Session, base: Runtime, component: str, versions: list[Version]) -> list[Runtime]:
    """The derived runtimes of `base` for each version (existing rows reused: a resumed bisect finds them),
    each made through the component's source (`matrix.variants`). The base's own version is the base
    recipe itself under a variant's name, so it reuses the base's environment."""
    from matrix.variants import derive_runtime

    rows = []
    for version in versions:
        if base.provider.get("kind") == "venv" and {c.name: c.version for c in base.components}.get(component) == str(
            version
        ):
            rows.append(_same_as_base(session, base, component, str(version)))
            continue
        rows.append(derive_runtime(session, base, {component: str(version)}, how="matrix bisect --component"))
    return rows


def _same_as_base(session: Session, base: Runtime, component: str, version: str) -> Runtime:
    """A probe at the base's own component version: the base recipe under the variant's name."""
    name = variant_version(base.version, component, version)
    row = session.scalar(select(Runtime).where(Runtime.backend_id == base.backend_id, Runtime.version == name))
    if row is None:
        row = Runtime(
            backend=base.backend, version=name, tag=tag_for(parse_version(name)), channel=base.channel,
            provider=dict(base.provider), notes=f"{base.label}: its own {component} {version} (bisect --component)",
            source=DERIVED, enabled=True, retired=False,
            components=[RuntimeComponent(name=c.name, version=c.version) for c in base.components],
        )  # fmt: skip
        session.add(row)
        session.flush()
    return row
