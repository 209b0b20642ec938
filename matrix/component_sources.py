"""Where a backend's components come from when they are not a pip pin of their own name: one table.

`vllm-rs` is not a distribution: it is the file `vllm/vllm-rs` inside the CUDA wheel `vllm==V` (exposed
from the installed wheel on CUDA runtimes, extracted from a wheel that is not installed on CPU ones).
`nixl` is a pip pin that moves with its CUDA companion (`nixl-cu12`/`nixl-cu13==V`). The SGLang gRPC
bridge is a module inside `sglang==V` itself, so it cannot change without SGLang.

Everything that varies one component (`matrix runtime derive`, `run --with`, catalog `base` + `with`,
`bisect --component`) reads this table; a component that is in neither the table nor a recipe pin is
refused with the reason. Here too is the recipe surgery they share (pure: dicts in, dicts out), so the
catalog resolves a `base` + `with` entry without the database.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from matrix.errors import ConfigError
from matrix.versions import parse_version


@dataclass(frozen=True)
class WheelMember:
    """The component is one file of the wheel `project==V` (its releases are that project's on the index)."""

    project: str
    member: str

    def requirement(self, version: str) -> str:
        return f"{self.project}=={version}"

    def describe(self) -> str:
        return f"member {self.member} of the wheel {self.project}==V"


@dataclass(frozen=True)
class PipPins:
    """The component is the pip pin `project==V`, with companions pinned to the same version."""

    project: str
    companions: tuple[str, ...] = ()

    def describe(self) -> str:
        also = "".join(f" with {c}==V" for c in self.companions)
        return f"the pip pin {self.project}==V{also}"


@dataclass(frozen=True)
class Bundled:
    """The component ships inside another distribution and cannot be changed on its own."""

    project: str

    def describe(self) -> str:
        return f"inside {self.project}==V (changes only with {self.project})"


Source = WheelMember | PipPins | Bundled

_VLLM_RS = WheelMember("vllm", "vllm/vllm-rs")

SOURCES: dict[str, dict[str, Source]] = {
    "vllm": {"vllm-rs": _VLLM_RS, "nixl": PipPins("nixl", ("nixl-cu12", "nixl-cu13"))},
    "vllm-cpu": {"vllm-rs": _VLLM_RS, "nixl": PipPins("nixl", ("nixl-cu12",))},
    "sglang": {"sglang-grpc-bridge": Bundled("sglang"), "nixl": PipPins("nixl", ("nixl-cu12", "nixl-cu13"))},
}


def source_for(backend: str, component: str) -> Source | None:
    """The table's source of `component` on `backend`, or None (then only a recipe pin of its name can vary it)."""
    return SOURCES.get(backend, {}).get(str(canonicalize_name(component)))


def index_project(backend: str, component: str) -> str:
    """The project whose releases on the index are the component's versions (`vllm` for `vllm-rs`)."""
    source = source_for(backend, component)
    return source.project if isinstance(source, WheelMember | PipPins) else str(canonicalize_name(component))


# --- pip pins (also `bisect --component` of a plain dependency) -------------------------------------------


@dataclass(frozen=True)
class Pinned:
    """Where the recipe pins the component: the old version, and every requirement name moved with it."""

    old: str
    names: tuple[str, ...]


def _pin(arg: str, component: str, old: str | None) -> tuple[str, str, str] | None:
    """(canonical name, pinned version, requirement text) when `arg` pins the component or a companion."""
    if arg.startswith("-") or "==" not in arg:
        return None
    try:
        req = Requirement(arg)
    except InvalidRequirement:
        return None
    name = canonicalize_name(req.name)
    pins = [s.version for s in req.specifier if s.operator == "=="]
    if len(pins) != 1:
        return None
    if name == component or (name.startswith(component + "-") and (old is None or pins[0] == old)):
        return name, pins[0], arg
    return None


def _repin(arg: str, version: str) -> str:
    req = Requirement(arg)
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    marker = f"; {req.marker}" if req.marker else ""
    return f"{req.name}{extras}=={version}{marker}"


def find_pin(provider: dict[str, Any], component: str) -> Pinned | None:
    """The component's `==` pin in a venv recipe's pip steps, or None when the recipe pins none."""
    component = canonicalize_name(component)
    old: str | None = None
    names: set[str] = set()
    for step in provider.get("steps", []):
        args = step if isinstance(step, list) else [step.get("requirements_of", ""), *step.get("with", [])]
        for arg in args:
            if isinstance(arg, str) and (hit := _pin(arg, component, None)) and hit[0] == component:
                old = hit[1]
    if old is None:
        return None
    for step in provider.get("steps", []):
        args = step if isinstance(step, list) else [step.get("requirements_of", ""), *step.get("with", [])]
        for arg in args:
            if isinstance(arg, str) and (hit := _pin(arg, component, old)):
                names.add(hit[0])
    return Pinned(old, tuple(sorted(names)))


def pin_component(provider: dict[str, Any], component: str, version: str, where: str) -> dict[str, Any]:
    """The provider with every pin of the component (and its lockstep companions) set to `version`."""
    if provider.get("kind") != "venv":
        raise ConfigError(
            f"{where}: its provider is {provider.get('kind')!r}; --component needs a venv recipe whose pip steps "
            'pin the component (e.g. "nixl==1.5.0")'
        )
    pinned = find_pin(provider, component)
    if pinned is None:
        raise ConfigError(
            f"{where}: its recipe pins no {component} (no '{component}==X' in its pip steps); --component needs "
            "a runtime whose recipe installs the component with a version pin (a matrix_plugin step is opaque)"
        )
    canonical = canonicalize_name(component)

    def repin(arg: Any) -> Any:
        if isinstance(arg, str) and (hit := _pin(arg, canonical, pinned.old)):
            return _repin(hit[2], version)
        return arg

    steps: list[Any] = []
    for step in provider["steps"]:
        if isinstance(step, list):
            steps.append([repin(a) for a in step])
        else:
            new = dict(step)
            if "requirements_of" in new:
                new["requirements_of"] = repin(new["requirements_of"])
            if "with" in new:
                new["with"] = [repin(a) for a in new["with"]]
            steps.append(new)
    return {**provider, "steps": steps}


# --- variants ---------------------------------------------------------------------------------------------


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
            component, parsed = str(canonicalize_name(name.strip())), str(parse_version(version.strip()))
        except ConfigError as exc:
            raise ConfigError(f"{option} {value!r}: {exc}") from None
        # A second version of one component would silently win over the first: the variant is one or the other.
        if component in changes and changes[component] != parsed:
            raise ConfigError(
                f"{option} names {component} twice ({changes[component]} and {parsed}): a variant has one version "
                f"of each component; give one {option} {component}=VERSION"
            )
        changes[component] = parsed
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
