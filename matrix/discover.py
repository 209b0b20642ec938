"""`matrix discover`: versions of a backend's package on the index that the catalog does not have yet.

The index is read through the PEP 691 JSON simple API (the same API pip uses), from `--index-url`, else
pip's own setting (`PIP_INDEX_URL`, then pip's configuration files), else PyPI, so a mirror works the
same way pip does. Each new version becomes a runtime from the backend's `runtime_template`, with
`source = "discovered"`: `matrix catalog sync` never retires it (it is nobody's file's row).
"""

from __future__ import annotations

import configparser
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from packaging.specifiers import InvalidSpecifier, SpecifierSet
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


@dataclass
class Found:
    """One version on the index and what discover did with it."""

    version: str
    files: int = 0
    yanked: str | None = None  # the reason ("" when none was given) when every file is yanked
    action: str = ""  # added | would add | yanked | older | channel | python | outside
    requires_python: list[str] = field(default_factory=list)  # each file's Requires-Python, where given


@dataclass
class Discovery:
    backend: str
    package: str
    index_url: str
    newest_known: str | None
    found: list[Found] = field(default_factory=list)
    malformed: list[str] = field(default_factory=list)  # file entries no version could be read from

    def as_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "package": self.package, "index_url": self.index_url,
            "newest_known": self.newest_known, "malformed": self.malformed,
            "versions": [vars(f) for f in self.found if f.action in ("added", "would add", "yanked", "python")],
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


def _file_version(filename: str) -> Version | None:
    try:
        if filename.endswith(".whl"):
            return parse_wheel_filename(filename)[1]
        return parse_sdist_filename(filename)[1]
    except (InvalidWheelFilename, InvalidSdistFilename):
        return None


def versions_on_index(data: dict[str, Any]) -> tuple[dict[Version, Found], list[str]]:
    """Every version with its file count and yank state, and the file entries that are malformed."""
    by_version: dict[Version, list[Any]] = {}
    requires_python: dict[Version, list[str]] = {}
    malformed: list[str] = []
    for entry in data["files"]:
        filename = entry.get("filename") if isinstance(entry, dict) else None
        version = _file_version(filename) if isinstance(filename, str) else None
        if version is None:
            malformed.append(str(filename if isinstance(filename, str) else entry)[:200])
            continue
        by_version.setdefault(version, []).append(entry.get("yanked", False))
        requires = entry.get("requires-python")
        if isinstance(requires, str) and requires.strip():
            requires_python.setdefault(version, []).append(requires.strip())
    found = {}
    for version, yanks in by_version.items():
        # PEP 592: a version is yanked when all its files are; the value is False, True or the reason.
        yanked = None
        if all(y not in (False, None) for y in yanks):
            yanked = next((y for y in yanks if isinstance(y, str) and y), "")
        found[version] = Found(str(version), files=len(yanks), yanked=yanked,
                               requires_python=requires_python.get(version, []))  # fmt: skip
    return found, malformed


def _python_fits(item: Found, python: str | None) -> bool:
    """Whether some file of the version accepts the template's interpreter (PEP 691 `requires-python`).

    A file without the field, or with one `packaging` cannot read, is taken to fit: pip decides then."""
    if not python:
        return True
    try:
        # "3.11" is any 3.11.x: the first and a late patch release stand for the line.
        line = python.count(".") < 2
        interpreters = [Version(python + ".0"), Version(python + ".99")] if line else [Version(python)]
    except InvalidVersion:
        return True
    if len(item.requires_python) < item.files:
        return True
    for text in item.requires_python:
        try:
            if any(SpecifierSet(text).contains(v, prereleases=True) for v in interpreters):
                return True
        except InvalidSpecifier:
            return True
    return False


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


def _template_python(template: dict[str, Any]) -> str | None:
    python = template.get("provider", {}).get("python")
    return str(python) if python else None


def discover(
    session: Session, backend_name: str, *, package: str | None, index_url: str | None, channel: str, dry_run: bool
) -> Discovery:
    backend, template, package = _backend_and_template(session, backend_name, package, channel)
    index = index_url or default_index_url()
    known_versions = [parse_version(r.version) for r in backend.runtimes]
    live = [parse_version(r.version) for r in backend.runtimes if not r.retired]
    newest = max(live) if live else None
    result = Discovery(backend_name, package, index, str(newest) if newest else None)
    found, result.malformed = versions_on_index(fetch_project(index, package))
    for version in sorted(found):
        item = found[version]
        result.found.append(item)
        if version in known_versions or (newest is not None and version <= newest):
            item.action = "older"
        elif not _in_channel(version, channel):
            item.action = "channel"
        elif item.yanked is not None:
            item.action = "yanked"
        elif not _python_fits(item, _template_python(template)):
            item.action = "python"
        elif dry_run:
            item.action = "would add"
        else:
            _add_runtime(session, backend, version, template, index)
            item.action = "added"
    return result


def fill_between(
    session: Session, backend_name: str, low: str, high: str, *, index_url: str | None, channel: str = "release"
) -> Discovery:
    """Add the index's versions from `low` to `high` (both included) that the catalog lacks, through the
    backend's template: what `matrix bisect --from-index` walks. Older versions than the catalog's are
    welcome here (a bisect reaches back); yanked ones, other channels and ones whose files all refuse the
    template's Python are left out and reported, as `discover` does."""
    backend, template, package = _backend_and_template(session, backend_name, None, channel)
    index = index_url or default_index_url()
    lo, hi = sorted((parse_version(low), parse_version(high)))
    known = {parse_version(r.version) for r in backend.runtimes}
    live = [parse_version(r.version) for r in backend.runtimes if not r.retired]
    result = Discovery(backend_name, package, index, str(max(live)) if live else None)
    found, result.malformed = versions_on_index(fetch_project(index, package))
    for version in sorted(found):
        item = found[version]
        if not lo <= version <= hi:
            continue
        result.found.append(item)
        if version in known:
            item.action = "known"
        elif not _in_channel(version, channel):
            item.action = "channel"
        elif item.yanked is not None:
            item.action = "yanked"
        elif not _python_fits(item, _template_python(template)):
            item.action = "python"
        else:
            _add_runtime(session, backend, version, template, index)
            item.action = "added"
    return result


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
