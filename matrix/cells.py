"""The cell and what it is made of: a case, a runtime, the fixes a case requires, the cell's stable id.

A leaf: it imports nothing of matrix but other leaves (`arm_table`, `case_launch`, `kv_bound`, `markers`,
`traffic_profile`, `versions`, `errors`), so every stage (plan, schedule, execute, launch, record, report) can
name a cell without reaching the database.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from packaging.version import Version

from matrix.arm_table import LAUNCH_TYPES, memory_facts, parse_launch
from matrix.case_launch import CommonLaunch
from matrix.kv_bound import KvBound
from matrix.markers import MarkerUse
from matrix.traffic_profile import TrafficProfile
from matrix.versions import parse_version

_GPU_MARKER = re.compile(r"^gpu_(\d+)$")
# A cell's stable id: 12 hex digits (48 bits) of its key's hash. A collision among 10,000 cells has odds of
# about 1 in 5 million, and is detected (`matrix.fanout.shards.index_cells`) rather than silently merging two cells.
_ID_HEX = 12


def cell_id(key: str) -> str:
    """The stable id of a cell key `CASE@BACKEND-VERSION` or, for a skew cell, `CASE@BACKEND[prefill=A,decode=B]`
    (database ids change between databases; keys do not)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:_ID_HEX]


@dataclass(frozen=True)
class RequiredFix:
    key: str
    component: str
    fixed_in: tuple[str, ...]
    link: str = ""


def launch_table(arm: str, launch: Mapping[str, Any]) -> CommonLaunch:
    """`launch` typed for `arm`; an arm no table knows gets the common keys (the runner then fails the cell
    on the unknown arm, as it did before the tables were typed)."""
    return parse_launch(arm, launch) if arm in LAUNCH_TYPES else parse_launch_common(launch)


def parse_launch_common(launch: Mapping[str, Any]) -> CommonLaunch:
    values: dict[str, Any] = {}
    for name in CommonLaunch.__dataclass_fields__:
        if name in launch:
            values[name] = tuple(launch[name]) if isinstance(launch[name], list) else launch[name]
    return CommonLaunch(**values)


@dataclass(frozen=True)
class CaseInfo:
    """The parts of a case that planning and launching need, detached from the database."""

    name: str
    backend: str
    arm: str
    model: str
    markers: tuple[MarkerUse, ...]
    marker_texts: tuple[str, ...] = ()
    payload: Mapping[str, Any] = field(default_factory=dict)
    kv_bound: KvBound = field(default_factory=KvBound)
    startup_timeout_s: float = 300.0
    request_timeout_s: float = 60.0
    # The case's launch table typed for its arm (`case_launch`): every reader reads its fields, and a field
    # left None takes the arm's default where it is read. A mapping given here (a table as written in TOML,
    # e.g. by a test) is parsed once, in `__post_init__`; the catalog hands over the parsed table.
    launch: CommonLaunch = field(default_factory=CommonLaunch)
    source_dir: str = ""
    version_constraint: str = ""
    required_fixes: tuple[RequiredFix, ...] = ()
    weights_gib: float = 0.0
    enabled: bool = True
    id: int | None = None
    # The concurrent load of the traffic check ([M27], `matrix.check.traffic`); None: the case has none.
    traffic: TrafficProfile | None = None
    # What the scheduler needs of the arm, computed here, once, from the arm's row (`arm_table.memory_facts`):
    # whether the case runs on a host without GPUs, and whether every instance's GPU memory is bounded
    # absolutely (then its start-up may overlap others on the GPU). Not arguments: always the row's word.
    runs_on_cpu: bool = field(init=False, compare=False)
    absolute_memory: bool = field(init=False, compare=False)

    def __post_init__(self) -> None:
        given: object = self.launch
        if isinstance(given, Mapping):
            object.__setattr__(self, "launch", launch_table(self.arm, given))
        elif type(given) is CommonLaunch and self.arm in LAUNCH_TYPES:
            # The default (or a table of common keys only): widened to the arm's type, its own keys left out.
            common = {spec.name: getattr(given, spec.name) for spec in fields(CommonLaunch)}
            object.__setattr__(self, "launch", LAUNCH_TYPES[self.arm](**common))
        cpu, absolute = memory_facts(self.arm, self.kv_bound, self.launch)
        object.__setattr__(self, "runs_on_cpu", cpu)
        object.__setattr__(self, "absolute_memory", absolute)

    @property
    def gpus_needed(self) -> int:
        """GPUs the case needs, from its `gpu_N` marker (0 when it has none)."""
        for use in self.markers:
            if m := _GPU_MARKER.match(use.name):
                return int(m.group(1))
        return 0


@dataclass(frozen=True)
class RuntimeInfo:
    backend: str
    version: str
    tag: str
    channel: str = "release"
    provider: Mapping[str, Any] = field(default_factory=dict)
    components: Mapping[str, str] = field(default_factory=dict)
    enabled: bool = True
    id: int | None = None
    # A variant made by `matrix bisect --component` (source "derived"): planned only when named by --runtime.
    derived: bool = False
    # `provider` parsed into its typed recipe (`launch.providers.recipe.with_spec`), once per run for all the
    # runtime's cells (the campaign's `HostHooks.with_specs`), so no cell parses it again; None: not parsed (a
    # builtin runtime, one made in code, or an entry that does not parse, whose cells fail on it as before).
    # Typed `object` because the recipe types live with their parser (it needs `packaging` and the plugin
    # directory), out of this leaf's reach; the providers read it through `host_config`, `venv_recipe` and
    # `container_config`. A `replace` of `provider` must drop it (`spec=None`).
    spec: object = field(default=None, compare=False, repr=False)

    @property
    def label(self) -> str:
        return f"{self.backend}-{self.version}"

    @property
    def parsed_version(self) -> Version:
        return parse_version(self.version)


# The roles a cell's processes play, in the order a skew cell's key names them (a Dynamo arm has a frontend).
ROLES = ("frontend", "prefill", "decode")


def roles_key(roles: Mapping[str, str]) -> str:
    """`prefill=0.29.0,decode=0.30.0` for {role: version} in ROLES order; '' for a diagonal cell."""
    return ",".join(f"{role}={roles[role]}" for role in ROLES if role in roles)


def skew_cell_key(case: str, backend: str, version: str, roles: Mapping[str, str]) -> str:
    """A cell's key from its parts (a database row's too): `CASE@BACKEND-VERSION` for a diagonal cell,
    `CASE@BACKEND[prefill=A,decode=B]` for a skew one."""
    return f"{case}@{backend}[{roles_key(roles)}]" if roles else f"{case}@{backend}-{version}"


@dataclass(frozen=True)
class Cell:
    case: CaseInfo
    runtime: RuntimeInfo
    # Required fixes this runtime lacks, e.g. ("vllm#54814",): the cell is expected to fail.
    missing_fixes: tuple[str, ...] = ()
    missing_reasons: tuple[str, ...] = ()
    # A skew cell's runtime per role, every role the skew names, in ROLES order; roles it does not name run
    # `runtime`. Empty for an ordinary (diagonal) cell, so its key stays `CASE@BACKEND-VERSION`.
    roles: tuple[tuple[str, RuntimeInfo], ...] = ()

    def runtime_of(self, role: str) -> RuntimeInfo:
        """The runtime whose environment runs `role`'s process."""
        return dict(self.roles).get(role, self.runtime)

    @property
    def skewed(self) -> bool:
        return bool(self.roles)

    @property
    def runtimes(self) -> tuple[RuntimeInfo, ...]:
        """Every runtime the cell's processes run, each once: a skew cell's roles' runtimes too."""
        found: dict[str, RuntimeInfo] = {}
        for runtime in (self.runtime, *(r for _, r in self.roles)):
            found.setdefault(runtime.label, runtime)
        return tuple(found.values())

    @property
    def role_versions(self) -> dict[str, str]:
        """{role: version} of a skew cell ({} for a diagonal one): what the database records per role."""
        return {role: runtime.version for role, runtime in self.roles}

    @property
    def key(self) -> str:
        return skew_cell_key(self.case.name, self.runtime.backend, self.runtime.version, self.role_versions)

    @property
    def expected_failure(self) -> str:
        return "; ".join(self.missing_reasons)

    def as_dict(self) -> dict[str, Any]:
        """The cell as `matrix plan --json` prints it."""
        return {
            "cell": self.key, "id": cell_id(self.key), "case": self.case.name, "backend": self.runtime.backend,
            "version": self.runtime.version, "tag": self.runtime.tag, "arm": self.case.arm,
            "gpus": self.case.gpus_needed, "markers": list(self.case.marker_texts),
            "missing_fixes": list(self.missing_fixes), "note": self.expected_failure,
            "roles": self.role_versions,
        }  # fmt: skip
