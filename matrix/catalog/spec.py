"""Typed, validated catalog entries as read from `data/*.toml`, before they touch the database."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from matrix.kv_bound import KvBound
from matrix.traffic_profile import TrafficProfile

MARKER_KINDS = ("lifecycle", "hardware", "framework", "kind", "other", "resource")
CHANNELS = ("release", "rc", "dev", "nightly")
PROVIDER_KINDS = ("builtin", "host", "venv", "container")


@dataclass(frozen=True)
class BackendSpec:
    name: str
    description: str = ""
    # `runtime_template`: how `matrix discover` makes a runtime of a version found on the index.
    runtime_template: dict[str, Any] | None = None


@dataclass(frozen=True)
class RuntimeSpec:
    backend: str
    version: str
    tag: str
    channel: str
    provider: dict[str, Any]
    components: dict[str, str]
    enabled: bool = True
    notes: str = ""
    # A variant (`base` + `with`): its base's version and the components it changes; the recipe and
    # components above are the base's with those changed (`matrix.component_sources.derive`).
    base: str = ""
    vary: dict[str, str] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.backend, self.version)


@dataclass(frozen=True)
class MarkerSpec:
    name: str
    kind: str = "other"
    description: str = ""
    parametrised: bool = False


@dataclass(frozen=True)
class FixSpec:
    key: str
    component: str
    fixed_in: list[str]
    link: str = ""
    description: str = ""


@dataclass(frozen=True)
class CaseSpec:
    name: str
    backend: str
    arm: str
    model: str
    markers: list[str]
    description: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    kv_bound: KvBound = field(default_factory=KvBound)
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 60.0
    launch: dict[str, Any] = field(default_factory=dict)
    source_dir: str = ""
    version_constraint: str = ""
    requires_fixes: list[str] = field(default_factory=list)
    weights_gib: float = 0.0
    enabled: bool = True
    # The `traffic` table ([M27]): the concurrent load the traffic check puts on the pair; None: none.
    traffic: TrafficProfile | None = None


@dataclass(frozen=True)
class GateSpec:
    name: str
    expression: str
    description: str = ""
    rules: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WaiverSpec:
    case: str
    reason: str
    runtime_spec: str = ""
    link: str = ""
    expires: dt.date | None = None
    owner: str = ""


@dataclass
class CatalogSpec:
    """Everything read from a set of catalog files; `kinds` says which entry kinds the files define."""

    backends: list[BackendSpec] = field(default_factory=list)
    runtimes: list[RuntimeSpec] = field(default_factory=list)
    markers: list[MarkerSpec] = field(default_factory=list)
    fixes: list[FixSpec] = field(default_factory=list)
    cases: list[CaseSpec] = field(default_factory=list)
    gates: list[GateSpec] = field(default_factory=list)
    waivers: list[WaiverSpec] = field(default_factory=list)
    kinds: set[str] = field(default_factory=set)
    # The source of every entry, by (kind, natural key), and the sources of the files read (see
    # `matrix.catalog.load.source_id`): sync records a row's source and retires only rows of these files.
    sources: dict[tuple[str, Any], str] = field(default_factory=dict)
    files: set[str] = field(default_factory=set)
    # What a reader should know that is not an error: a file that defines nothing (0 bytes, or only comments).
    warnings: list[str] = field(default_factory=list)
