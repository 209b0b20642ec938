"""A wheelhouse: a directory of wheels plus ``wheelhouse.json``, the exact files each runtime's recipe installs
on one target, step by step, so an air-gapped host builds the environment without an index.

``matrix runtime wheelhouse`` writes it (`matrix.launch.providers.wheelresolve`); ``matrix runtime provision
--find-links DIR --offline`` and ``matrix run ... --offline`` read it. Runtimes are found by their recipe's
key for the target (see `VenvRecipe.key`), so a lock is used only for the very recipe, Python and platform
it was made for. Every problem is a `ConfigError` that names the missing piece and the command that makes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matrix.errors import ConfigError

MANIFEST_NAME = "wheelhouse.json"
FORMAT = 1
CHUNK = 1 << 20


@dataclass(frozen=True)
class LockedFile:
    """One wheel of a lock."""

    filename: str
    name: str
    version: str
    sha256: str
    size: int

    def as_json(self) -> dict[str, Any]:
        return {"filename": self.filename, "name": self.name, "version": self.version, "sha256": self.sha256,
                "size": self.size}  # fmt: skip


@dataclass(frozen=True)
class LockedStep:
    """What one recipe step takes from the wheelhouse.

    `install`: the files `pip install --no-deps` gets, in order. `source`: the wheel a `requirements_of` or
    `extract` step reads (not installed). `build`: the build requirements of a matrix plugin. `excluded`:
    names the step's resolution had that the host provides (not in the wheelhouse). `omitted`: names left
    out altogether, because the runtime never imports them there (not in the wheelhouse, not installed)."""

    describe: str
    install: tuple[LockedFile, ...] = ()
    source: LockedFile | None = None
    build: tuple[LockedFile, ...] = ()
    excluded: tuple[str, ...] = ()
    omitted: tuple[str, ...] = ()

    def files(self) -> tuple[LockedFile, ...]:
        return (*self.install, *((self.source,) if self.source else ()), *self.build)

    def as_json(self) -> dict[str, Any]:
        return {
            "step": self.describe,
            "install": [f.as_json() for f in self.install],
            "source": self.source.as_json() if self.source else None,
            "build": [f.as_json() for f in self.build],
            "excluded": list(self.excluded),
            "omitted": list(self.omitted),
        }


@dataclass(frozen=True)
class RuntimeLock:
    """The lock of one runtime for the wheelhouse's target."""

    label: str
    key: str
    steps: tuple[LockedStep, ...]
    excluded: tuple[str, ...] = ()  # provided by the host, over all steps
    omitted: tuple[str, ...] = ()  # not needed there, over all steps

    def files(self) -> tuple[LockedFile, ...]:
        return tuple(f for step in self.steps for f in step.files())

    def as_json(self) -> dict[str, Any]:
        return {"label": self.label, "key": self.key, "excluded": list(self.excluded),
                "omitted": list(self.omitted), "steps": [s.as_json() for s in self.steps]}  # fmt: skip


@dataclass(frozen=True)
class Manifest:
    """``wheelhouse.json``: the target and the lock of every runtime made for it, by label."""

    python: str
    platforms: tuple[str, ...]
    key_platform: str
    created: str
    runtimes: Mapping[str, RuntimeLock] = field(default_factory=dict)
    # Every `matrix runtime wheelhouse` command that put runtimes here, in order, options spelled out.
    commands: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "created": self.created,
            "target": {"python": self.python, "platforms": list(self.platforms), "key_platform": self.key_platform},
            "runtimes": {label: lock.as_json() for label, lock in sorted(self.runtimes.items())},
            "commands": list(self.commands),
        }

    def merged(self, other: Manifest) -> Manifest:
        """This manifest with `other`'s runtimes added or replaced; refused for another target, since a
        directory holds the wheels of one target."""
        if (self.python, self.key_platform) != (other.python, other.key_platform):
            raise ConfigError(
                f"the wheelhouse holds wheels for Python {self.python} {self.key_platform} "
                f"({', '.join(self.platforms)}), not Python {other.python} {other.key_platform}: "
                "give another --out directory"
            )
        platforms = tuple(dict.fromkeys((*self.platforms, *other.platforms)))
        commands = tuple(dict.fromkeys((*self.commands, *other.commands)))
        return Manifest(self.python, platforms, self.key_platform, self.created, {**self.runtimes, **other.runtimes},
                        commands)  # fmt: skip

    def lock_for(self, key: str) -> RuntimeLock | None:
        """The lock of a recipe by its key (several runtimes may share one recipe)."""
        return next((lock for lock in self.runtimes.values() if lock.key == key), None)


def _file(raw: Mapping[str, Any]) -> LockedFile:
    return LockedFile(str(raw["filename"]), str(raw["name"]), str(raw["version"]), str(raw["sha256"]),
                      int(raw["size"]))  # fmt: skip


def _step(raw: Mapping[str, Any]) -> LockedStep:
    return LockedStep(
        describe=str(raw["step"]),
        install=tuple(_file(f) for f in raw["install"]),
        source=_file(raw["source"]) if raw.get("source") else None,
        build=tuple(_file(f) for f in raw.get("build", [])),
        excluded=tuple(str(n) for n in raw.get("excluded", [])),
        omitted=tuple(str(n) for n in raw.get("omitted", [])),
    )


def manifest_from_json(document: Mapping[str, Any]) -> Manifest:
    """Parse a manifest document; `KeyError`/`TypeError`/`ValueError` when it is malformed."""
    if document.get("format") != FORMAT:
        raise ValueError(f"format {document.get('format')!r}, this matrix reads format {FORMAT}")
    target = document["target"]
    runtimes = {
        str(label): RuntimeLock(
            str(raw["label"]),
            str(raw["key"]),
            tuple(_step(s) for s in raw["steps"]),
            tuple(str(n) for n in raw.get("excluded", [])),
            tuple(str(n) for n in raw.get("omitted", [])),
        )
        for label, raw in document["runtimes"].items()
    }
    return Manifest(str(target["python"]), tuple(target["platforms"]), str(target["key_platform"]),
                    str(document["created"]), runtimes,
                    tuple(str(c) for c in document.get("commands", [])))  # fmt: skip


def read_manifest(directory: Path) -> Manifest | None:
    """The manifest in `directory`, None when there is none; `ConfigError` when it is unreadable."""
    path = directory / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return manifest_from_json(json.loads(text))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ConfigError(f"{path} is not a wheelhouse manifest ({exc}): make it again with "
                          "`matrix runtime wheelhouse --out DIR`") from None  # fmt: skip


def write_manifest(directory: Path, manifest: Manifest) -> Path:
    """Write atomically (rename), so a reader never sees half a manifest."""
    path = directory / MANIFEST_NAME
    tmp = directory / f".{MANIFEST_NAME}.{os.getpid()}-{secrets.token_hex(3)}"
    tmp.write_text(json.dumps(manifest.as_json(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def manifest_digest(directory: Path) -> str:
    """sha256 of the manifest file as it is on disk (recorded in env.json of an environment built from it)."""
    return hashlib.sha256((directory / MANIFEST_NAME).read_bytes()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ProvisionSource:
    """Where provisioning takes packages from: the index (the default), the index plus a directory of
    wheels (`find_links`), or only the wheelhouse `find_links` (`offline`)."""

    find_links: Path | None = None
    offline: bool = False

    @classmethod
    def of(cls, find_links: Path | None, offline: bool) -> ProvisionSource:
        """Checked options (`ConfigError`): --offline needs --find-links, whose manifest must be readable."""
        if offline and find_links is None:
            raise ConfigError("--offline needs --find-links DIR (a wheelhouse made by `matrix runtime wheelhouse --out "
                              "DIR`)")  # fmt: skip
        if find_links is None:
            return cls()
        directory = find_links.expanduser().resolve()
        if not directory.is_dir():
            raise ConfigError(f"--find-links {find_links}: no such directory")
        if offline and read_manifest(directory) is None:
            raise ConfigError(f"--find-links {find_links} has no {MANIFEST_NAME}: make the wheelhouse with "
                              f"`matrix runtime wheelhouse --out {find_links}` on a host with an index")  # fmt: skip
        return cls(directory, offline)

    def manifest(self) -> Manifest:
        assert self.find_links is not None
        manifest = read_manifest(self.find_links)
        if manifest is None:
            raise ConfigError(f"{self.find_links} has no {MANIFEST_NAME}")
        return manifest


def wheelhouse_command(backend: str, version: str, python: str, platform: str, directory: Path) -> str:
    """The command that puts the lock of runtime BACKEND=VERSION for a target into `directory`."""
    return (f"matrix runtime wheelhouse --runtime {backend}={version} --python {python} --platform {platform} "
            f"--out {directory}")  # fmt: skip


def check_files(directory: Path, files: Iterable[LockedFile], remake: str) -> None:
    """Every file is in `directory` with its recorded sha256; `ConfigError` naming the first that is not."""
    for locked in files:
        path = directory / locked.filename
        if not path.is_file():
            raise ConfigError(f"wheelhouse {directory} lacks {locked.filename} ({locked.name} {locked.version}): "
                              f"make it again with `{remake}`")  # fmt: skip
        found = file_sha256(path)
        if found != locked.sha256:
            raise ConfigError(
                f"wheelhouse file {path} does not match its checksum (sha256 {found}, the manifest says "
                f"{locked.sha256}): remove it and make it again with `{remake}`"
            )


def pylock_name(label: str) -> str:
    """PEP 751's file name for one runtime's lock: ``pylock.<name>.toml``, the name without dots."""
    return f"pylock.{label.replace('.', '_')}.toml"


def _toml(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid TOML basic string


def write_pylock(
    directory: Path,
    label: str,
    target: Any,
    files: Iterable[LockedFile],
    excluded: Iterable[str] = (),
    omitted: Iterable[str] = (),
) -> Path:
    """A PEP 751 lock of what runtime `label`'s environment holds on the target, its wheels by path in the
    wheelhouse; written atomically. Distributions left to the host or omitted are named in a comment."""
    lines = [f"# {label}: what matrix installs from this wheelhouse (recipe steps such as extract and alias are",
             "# in wheelhouse.json)"]  # fmt: skip
    if excluded := list(excluded):
        lines.append(f"# provided by the host, not locked here: {', '.join(excluded)}")
    if omitted := list(omitted):
        lines.append(f"# omitted (not imported on the target): {', '.join(omitted)}")
    environment = (f'python_version == "{target.python}" and sys_platform == "linux" and '
                   f'platform_machine == "{target.arch}"')  # fmt: skip
    requires = _toml(f"=={target.python}.*")
    lines += ['lock-version = "1.0"', 'created-by = "matrix"', f"requires-python = {requires}",
              f"environments = [{_toml(environment)}]", ""]  # fmt: skip
    for file in sorted(files, key=lambda f: f.name.lower()):
        lines += [
            "[[packages]]", f"name = {_toml(file.name)}", f"version = {_toml(file.version)}",
            f"wheels = [{{ name = {_toml(file.filename)}, path = {_toml(file.filename)}, size = {file.size}, "
            f"hashes = {{ sha256 = {_toml(file.sha256)} }} }}]", "",
        ]  # fmt: skip
    path = directory / pylock_name(label)
    tmp = directory / f".{path.name}.{os.getpid()}-{secrets.token_hex(3)}"
    tmp.write_text("\n".join(lines))
    os.replace(tmp, path)
    return path
