"""`matrix discover`: versions of a backend's package on the index that the catalog does not have yet.

The index is read through the PEP 691 JSON simple API (the same API pip uses), from `--index-url`, else
pip's own setting (`PIP_INDEX_URL`, then pip's configuration files), else PyPI, so a mirror works the
same way pip does. Each new version becomes a runtime from the backend's `runtime_template`, with
`source = "discovered"`: `matrix catalog sync` never retires it (it is nobody's file's row).

Before a version of a `venv` template is added, uv resolves `package==version` with its dependencies for the
runtime's own target (the template's Python on this host's platform) against the same index, metadata only:
a release whose requirements no index has (NIXL 1.5.2's meta wheel requires nixl-cu12==1.5.2, which does not
exist) is marked `unresolvable`, naming them, and never becomes a runtime, so no cell, plan or wheelhouse
meets it. An index uv cannot ask (no uv, offline, files it cannot read) leaves the check to the build.
"""

from __future__ import annotations

import configparser
import os
import platform
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags, platform_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version
from sqlalchemy import select
from sqlalchemy.orm import Session

from matrix.catalog.template import render
from matrix.db.models import Backend, Runtime, RuntimeComponent
from matrix.errors import ConfigError
from matrix.versions import parse_version, tag_for

PYPI_SIMPLE = "https://pypi.org/simple"
ACCEPT = "application/vnd.pypi.simple.v1+json"
CHANNELS = ("release", "rc", "dev")
DISCOVERED = "discovered"
# The actions of a version in range that was not added, each said with its reason.
SKIPPED = ("yanked", "python", "platform", "unresolvable")


@dataclass(frozen=True)
class IndexFile:
    """One file of a version: an sdist (pip can build it anywhere) or a wheel with its tags."""

    wheel_tags: frozenset[Tag] | None  # None: an sdist
    requires_python: str | None


@dataclass
class Found:
    """One version on the index and what discover did with it."""

    version: str
    files: int = 0
    yanked: str | None = None  # the reason ("" when none was given) when every file is yanked
    action: str = ""  # added | would add | yanked | older | known | channel | python | platform
    requires_python: list[str] = field(default_factory=list)  # each file's Requires-Python, where given
    wheels: list[str] = field(default_factory=list)  # the tags of each wheel (`cp312-cp312-manylinux_2_28_aarch64`)
    sdist: bool = False
    missing: list[str] = field(default_factory=list)  # unresolvable: the requirements no index has (uv's words)
    entries: list[IndexFile] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {key: value for key, value in vars(self).items() if key != "entries"}


@dataclass
class Discovery:
    backend: str
    package: str
    index_url: str
    newest_known: str | None
    found: list[Found] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # file entries no version could be read from
    target: Target | None = None  # the interpreter and platform the versions were checked against

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "package": self.package, "index_url": self.index_url,
            "newest_known": self.newest_known, "malformed": self.malformed,
            "target": {"python": self.target.python, "platform": self.target.platform or None}
            if self.target is not None else None,
            "versions": [f.as_dict() for f in self.found if f.action in ("added", "would add", *SKIPPED)],
        }  # fmt: skip


def _pip_config_files() -> list[Path]:
    """pip's configuration files, lowest priority first (pip's documented order: global, user, site, env)."""
    home = Path.home()
    xdg = os.environ.get("XDG_CONFIG_HOME", str(home / ".config"))
    files = [Path("/etc/xdg/pip/pip.conf"), Path("/etc/pip.conf"), home / ".pip" / "pip.conf",
             Path(xdg) / "pip" / "pip.conf", Path(sys.prefix) / "pip.conf"]  # fmt: skip
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    return files


def default_index_url() -> str:
    """pip's index: $PIP_INDEX_URL, else `index-url` of pip's configuration ([install] over [global])."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    found = ""
    for path in _pip_config_files():
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except (configparser.Error, OSError):
            continue  # pip would complain about it; for discovery it is simply not a source
        for section in ("global", "install"):
            if parser.has_option(section, "index-url"):
                found = parser.get(section, "index-url")
    return found or PYPI_SIMPLE


def fetch_project(index_url: str, package: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The PEP 691 project page of `package`; a `ConfigError` saying what the index answered otherwise."""
    url = f"{index_url.rstrip('/')}/{canonicalize_name(package)}/"
    try:
        response = httpx.get(url, headers={"Accept": ACCEPT}, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise ConfigError(f"cannot read {url}: {exc}; check --index-url (or PIP_INDEX_URL) and the network") from None
    if response.status_code == 404:
        raise ConfigError(f"package {package!r} is not on the index {index_url} (404); give the right --package")
    if response.status_code != 200:
        raise ConfigError(f"the index answered {response.status_code} for {url}; try again or use another --index-url")
    kind = response.headers.get("content-type", "").split(";")[0].strip()
    if kind != ACCEPT:
        raise ConfigError(
            f"{url} answered {kind or 'no content type'}, not the JSON simple API ({ACCEPT}, PEP 691); "
            "use an index that serves it (PyPI, devpi, a recent Artifactory/Nexus)"
        )
    try:
        data = response.json()
    except ValueError:
        raise ConfigError(f"{url} claims {ACCEPT} but its body is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        raise ConfigError(f"{url}: the project page has no 'files' list (PEP 691); is it a simple index?")
    return data


def _read_file(filename: str) -> tuple[Version, frozenset[Tag] | None] | None:
    """(version, wheel tags) of a file name, the tags None for an sdist; None when it names no version."""
    try:
        if filename.endswith(".whl"):
            _name, version, _build, tags = parse_wheel_filename(filename)
            return version, tags
        return parse_sdist_filename(filename)[1], None
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None


def versions_on_index(data: dict[str, Any]) -> tuple[dict[Version, Found], list[str]]:
    """Every version with its files and yank state, and the file entries that are malformed."""
    yanks: dict[Version, list[Any]] = {}
    found: dict[Version, Found] = {}
    malformed: list[str] = []
    for entry in data["files"]:
        filename = entry.get("filename") if isinstance(entry, dict) else None
        read = _read_file(filename) if isinstance(filename, str) else None
        if read is None:
            malformed.append(str(filename if isinstance(filename, str) else entry)[:200])
            continue
        version, tags = read
        item = found.setdefault(version, Found(str(version)))
        yanks.setdefault(version, []).append(entry.get("yanked", False))
        requires = entry.get("requires-python")
        requires = requires.strip() if isinstance(requires, str) and requires.strip() else None
        if requires is not None:
            item.requires_python.append(requires)
        if tags is None:
            item.sdist = True
        else:
            item.wheels.append("-".join(str(filename).removesuffix(".whl").split("-")[-3:]))  # python-abi-platform
        item.entries.append(IndexFile(tags, requires))
    for version, item in found.items():
        # PEP 592: a version is yanked when all its files are; the value is False, True or the reason.
        item.files = len(yanks[version])
        if all(y not in (False, None) for y in yanks[version]):
            item.yanked = next((y for y in yanks[version] if isinstance(y, str) and y), "")
    return found, malformed


@dataclass(frozen=True)
class Target:
    """The interpreter a runtime of the template gets, and the wheels pip could install into it here."""

    python: str | None  # for Requires-Python: "3.11" (any 3.11.x) or "3.11.7"; None: unknown, pip decides
    tags: frozenset[Tag] | None  # the wheel tags pip accepts there; None: not checked (nothing is built here)
    platform: str = ""  # this host's most specific platform tag, for the message

    def describe(self) -> str:
        return f"Python {self.python} on {self.platform}"


def runtime_target(template: dict[str, Any]) -> Target:
    """What a runtime made from `template` installs into. Only a `venv` provider builds an environment
    here, with the recipe's `python` (default: matrix's own interpreter), so only then are wheel tags
    known: CPython of that major.minor on this host's platforms, exactly the tags pip there accepts."""
    provider = template.get("provider", {})
    python = str(provider.get("python") or "") or None
    if provider.get("kind", "host") != "venv":
        return Target(python, None)
    from matrix.launch.providers.venv import ProvisionError, python_version_of

    if python is not None and _is_version(python):
        line = ".".join(python.split(".")[:2])  # "3.11" or "3.11.7": the line is what wheels are made for
    else:
        try:
            line = python_version_of(python or "")  # a path or command is asked for its version
        except ProvisionError:
            return Target(python, None)  # an interpreter not on this host: the build will say so
        python = platform.python_version() if python is None else line
    major, minor = (int(x) for x in line.split(".")[:2])
    platforms = list(platform_tags())
    tags = frozenset([*cpython_tags((major, minor), platforms=platforms),
                      *compatible_tags((major, minor), f"cp{major}{minor}", platforms)])  # fmt: skip
    named = [p for p in platforms if not p.startswith("linux_")]  # manylinux_2_39_x86_64 says more
    return Target(python, tags, (named or platforms or ["this platform"])[0])


def _is_version(text: str) -> bool:
    try:
        Version(text)
    except InvalidVersion:
        return False
    return True


def _python_fits(requires: str | None, python: str | None) -> bool:
    """Whether a file's PEP 691 `requires-python` accepts the interpreter. No field, no interpreter known,
    or a field `packaging` cannot read: taken to fit (pip decides then)."""
    if not python or requires is None:
        return True
    try:
        # "3.11" is any 3.11.x: the first and a late patch release stand for the line.
        line = python.count(".") < 2
        interpreters = [Version(python + ".0"), Version(python + ".99")] if line else [Version(python)]
    except InvalidVersion:
        return True
    try:
        return any(SpecifierSet(requires).contains(v, prereleases=True) for v in interpreters)
    except InvalidSpecifier:
        return True


def installable(item: Found, target: Target) -> str | None:
    """None when pip could install some file of the version into the target, else why not ("python": every
    file's Requires-Python refuses the interpreter; "platform": no sdist and no wheel for it here)."""
    fitting = [f for f in item.entries if _python_fits(f.requires_python, target.python)]
    if not fitting:
        return "python"
    if target.tags is None or any(f.wheel_tags is None or f.wheel_tags & target.tags for f in fitting):
        return None
    return "platform"


def _in_channel(version: Version, channel: str) -> bool:
    if version.is_devrelease:
        return channel == "dev"
    if version.is_prerelease:
        return channel in ("rc", "dev")
    return True


def _backend_and_template(
    session: Session, backend_name: str, package: str | None, channel: str
) -> tuple[Backend, dict[str, Any], str]:
    if channel not in CHANNELS:
        raise ConfigError(f"unknown --channel {channel!r}; choose one of {', '.join(CHANNELS)}")
    backend = session.scalar(select(Backend).where(Backend.name == backend_name, Backend.retired.is_(False)))
    if backend is None:
        known = ", ".join(session.scalars(select(Backend.name).where(Backend.retired.is_(False)))) or "none"
        raise ConfigError(f"unknown backend {backend_name!r}; known backends: {known}")
    template = backend.runtime_template
    if not template:
        raise ConfigError(
            f"backend {backend_name!r} declares no runtime_template, so a new version cannot become a runtime: "
            f"add runtime_template = {{ package = ..., provider = {{...}}, components = {{...}} }} to its [[backend]]"
        )
    package = package or str(template.get("package") or "")
    if not package:
        raise ConfigError(f"backend {backend_name!r}: give --package NAME (its runtime_template names no package)")
    return backend, template, package


def discover(
    session: Session, backend_name: str, *, package: str | None, index_url: str | None, channel: str, dry_run: bool,
    resolve: bool = True,
) -> Discovery:  # fmt: skip
    backend, template, package = _backend_and_template(session, backend_name, package, channel)
    known = {parse_version(r.version) for r in backend.runtimes}
    live = [parse_version(r.version) for r in backend.runtimes if not r.retired]
    newest = max(live) if live else None

    def place(version: Version) -> str | None:
        return "older" if version in known or (newest is not None and version <= newest) else None

    return _offer(session, backend, template, package, index_url, channel, place, dry_run=dry_run, resolve=resolve)


def fill_between(
    session: Session, backend_name: str, low: str, high: str, *, index_url: str | None, channel: str = "release"
) -> Discovery:
    """Add the index's versions from `low` to `high` (both included) that the catalog lacks, through the
    backend's template: what `matrix bisect --from-index` walks. Older versions than the catalog's are
    welcome here (a bisect reaches back); yanked ones, other channels and ones pip could not install into
    the template's interpreter here are left out and reported, as `discover` does."""
    backend, template, package = _backend_and_template(session, backend_name, None, channel)
    lo, hi = sorted((parse_version(low), parse_version(high)))
    known = {parse_version(r.version) for r in backend.runtimes}

    def place(version: Version) -> str | None:
        return "outside" if not lo <= version <= hi else "known" if version in known else None

    return _offer(session, backend, template, package, index_url, channel, place, dry_run=False)


def _offer(
    session: Session, backend: Backend, template: dict[str, Any], package: str, index_url: str | None, channel: str,
    place: Callable[[Version], str | None], *, dry_run: bool, resolve: bool = True,
) -> Discovery:  # fmt: skip
    """The one walk over the index's versions, oldest first: `place` answers "outside" (not listed), an
    action that settles the version ("older", "known"), or None for a candidate, which is then checked
    (channel, yanked, Requires-Python, wheel tags) and added unless `dry_run`."""
    index = index_url or default_index_url()
    live = [parse_version(r.version) for r in backend.runtimes if not r.retired]
    result = Discovery(backend.name, package, index, str(max(live)) if live else None)
    result.target = runtime_target(template)
    found, result.malformed = versions_on_index(fetch_project(index, package))
    for version in sorted(found):
        item = found[version]
        settled = place(version)
        if settled == "outside":
            continue
        result.found.append(item)
        if settled is not None:
            item.action = settled
        elif not _in_channel(version, channel):
            item.action = "channel"
        elif item.yanked is not None:
            item.action = "yanked"
        elif (why := installable(item, result.target)) is not None:
            item.action = why
        elif resolve and (missing := _missing(template, package, version, index)):
            item.action, item.missing = "unresolvable", missing
        elif dry_run:
            item.action = "would add"
        else:
            _add_runtime(session, backend, version, template, index)
            item.action = "added"
    return result


def _missing(template: dict[str, Any], package: str, version: Version, index: str) -> list[str]:
    """What no index has of `package==version`'s requirements on the runtime's own target (empty: it
    resolves, or nothing could be said; only `venv` templates build here, so only they are resolved)."""
    from matrix.launch.providers.wheelresolve import own_target, resolvability

    target = own_target(template.get("provider", {}))
    if target is None:
        return []
    missing = resolvability([[f"{package}=={version}"]], target, index_url=index).missing
    # The index lists the release itself: where uv does not see it (a Requires-Python it cannot read), that
    # says nothing about its requirements, and pip decides at the build as before.
    itself = canonicalize_name(package)
    return [m for m in missing if canonicalize_name(re.split(r"[<>=!~;\[ ]", m, maxsplit=1)[0]) != itself]


def _add_runtime(session: Session, backend: Backend, version: Version, template: dict[str, Any], index: str) -> None:
    provider, components, notes = render(template, str(version), f"backend {backend.name}")
    parsed_components = {name: str(parse_version(value)) for name, value in components.items()}
    channel = "dev" if version.is_devrelease else "rc" if version.is_prerelease else "release"
    session.add(
        Runtime(
            backend=backend, version=str(version), tag=tag_for(version), channel=channel, provider=provider,
            notes=notes or f"discovered on {index}", source=DISCOVERED, enabled=True, retired=False,
            components=[RuntimeComponent(name=n, version=v) for n, v in sorted(parsed_components.items())],
        )
    )  # fmt: skip
    session.flush()
