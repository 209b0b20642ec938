"""Make a wheelhouse: resolve every step of a venv recipe for a target host, then download its files.

Each step is resolved by ``pip install --dry-run --report`` for the target's interpreter and platform tags
(pip's JSON report names every file with its URL and sha256, without downloading wheels whose metadata
the index serves on its own), with the pins of the earlier steps as constraints, the way the sequential
build would keep them. A step lists only what it adds to the environment: a distribution an earlier step
installed at the same version is not installed again, as pip would not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.providers.recipe import (
    ExtractStep,
    PipStep,
    PluginStep,
    RequirementsOfStep,
    UninstallStep,
    VenvRecipe,
    parse_venv,
    plugin_path,
    select_requirements,
)
from matrix.launch.providers.wheelhouse import CHUNK, LockedFile, LockedStep, RuntimeLock, file_sha256
from matrix.launch.providers.wheeltarget import WheelTarget

Echo = Callable[[str], None]
RESOLVE_TIMEOUT_S = 900.0
DOWNLOAD_TIMEOUT_S = 60.0  # per read: a stalled server fails, a slow big download does not
_NO_MATCH = re.compile(r"No matching distribution found for (\S+)")

# pip evaluates the environment markers of dependencies for the interpreter it runs in, even with
# --python-version and --platform (pypa/pip#11664): a 3.11 host would drop `tomli; python_version < "3.11"`
# for a 3.10 target. So pip runs with the target's marker environment in place of its own.
_PIP_WITH_TARGET_MARKERS = """
import json, runpy, sys
from pip._vendor.packaging import markers
environment = json.loads(sys.argv.pop(1))
markers.default_environment = lambda: dict(environment)
sys.argv[0] = "pip"
runpy.run_module("pip", run_name="__main__", alter_sys=True)
"""


@dataclass(frozen=True)
class Resolved:
    """One file of pip's install report."""

    name: str
    version: str
    url: str
    sha256: str | None
    requires_dist: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return urllib.parse.unquote(urllib.parse.urlsplit(self.url).path.rsplit("/", 1)[-1])

    @property
    def canonical(self) -> str:
        return canonicalize_name(self.name)


def _resolved(item: Mapping[str, Any]) -> Resolved:
    info = item["download_info"]
    hashes = info.get("archive_info", {}).get("hashes", {})
    metadata = item["metadata"]
    return Resolved(str(metadata["name"]), str(metadata["version"]), str(info["url"]), hashes.get("sha256"),
                    tuple(metadata.get("requires_dist", ())))  # fmt: skip


def pip_report(
    args: Sequence[str], target: WheelTarget, constraints: Mapping[str, str] = {}, *, what: str = ""
) -> list[Resolved]:
    """What `pip install ARGS` would install on `target`, each file once; `ConfigError` when pip cannot."""
    with tempfile.TemporaryDirectory(prefix="matrix-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        argv = [
            sys.executable, "-c", _PIP_WITH_TARGET_MARKERS, json.dumps(target.marker_environment()),
            "install", "--dry-run", "--ignore-installed", "--report", str(report),
            "--only-binary=:all:", "--python-version", target.python, "--implementation", "cp",
            "--abi", target.abi, "--abi", "abi3", "--abi", "none",
            *(arg for tag in target.tags for arg in ("--platform", tag)), "--target", str(Path(tmp) / "target"),
        ]  # fmt: skip
        if constraints:
            pins = Path(tmp) / "constraints.txt"
            pins.write_text("".join(f"{name}=={version}\n" for name, version in sorted(constraints.items())))
            argv += ["-c", str(pins)]
        env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
        env.pop("PYTHONPATH", None)
        try:
            done = subprocess.run([*argv, *args], capture_output=True, text=True, env=env, timeout=RESOLVE_TIMEOUT_S,
                                  check=False, stdin=subprocess.DEVNULL)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ConfigError(f"{what}: pip did not resolve within {RESOLVE_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            raise _resolution_error(done.stdout + "\n" + done.stderr, target, what)
        try:
            items = json.loads(report.read_text())["install"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{what}: pip wrote no install report ({exc}); matrix needs pip 22.2 or newer") from None
    return [_resolved(item) for item in items]


def _resolution_error(output: str, target: WheelTarget, what: str) -> ConfigError:
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("WARNING:")]
    match = _NO_MATCH.search(output)
    if match:
        return ConfigError(
            f"{what}: no wheel of {match.group(1)} for Python {target.python} ({target.abi}, abi3 or none) on any "
            f"of the platforms tried: {', '.join(target.tags)}; pick a version that has one, or --exclude it "
            "if the target host provides it"
        )
    if "No module named pip" in output:
        return ConfigError(f"{what}: the interpreter running matrix ({sys.executable}) has no pip; install pip")
    return ConfigError(f"{what}: pip could not resolve it:\n" + "\n".join(lines[-15:]))


@dataclass
class PlannedStep:
    """One step as resolved, before its files are downloaded."""

    describe: str
    install: list[Resolved]
    source: Resolved | None = None
    build: list[Resolved] | None = None
    excluded: list[str] | None = None
    omitted: list[str] | None = None

    def downloads(self) -> list[Resolved]:
        return [*self.install, *([self.source] if self.source else []), *(self.build or [])]


@dataclass
class PlannedRuntime:
    label: str
    key: str
    steps: list[PlannedStep]
    excluded: list[str]
    omitted: list[str]


def check_recipe_python(recipe: VenvRecipe, target: WheelTarget, label: str) -> None:
    """A recipe that names its Python version is built with that version on the target too."""
    if re.fullmatch(r"\d+\.\d+", recipe.python) and recipe.python != target.python:
        raise ConfigError(
            f"runtime {label}'s recipe asks for Python {recipe.python}, the target is Python {target.python}: "
            f"make its wheelhouse with --python {recipe.python}"
        )


def _single(found: list[Resolved], requirement: str, what: str) -> Resolved:
    if len(found) != 1:
        raise ConfigError(f"{what}: resolving {requirement} without dependencies gave {len(found)} files")
    return found[0]


def plan_runtime(
    runtime: RuntimeInfo, target: WheelTarget, exclude: Iterable[str], echo: Echo, omit: Iterable[str] = ()
) -> PlannedRuntime:
    """Resolve every step of the runtime's recipe for `target`; `exclude` names what the host provides,
    `omit` what the runtime never imports there (both are left out of the wheelhouse)."""
    recipe = parse_venv(runtime.provider, runtime.label)
    check_recipe_python(recipe, target, runtime.label)
    excluded_names = {canonicalize_name(n) for n in exclude}
    omitted_names = {canonicalize_name(n) for n in omit} - excluded_names
    installed: dict[str, str] = {}  # canonical name -> version, as the sequential build would have it
    steps: list[PlannedStep] = []
    for number, step in enumerate(recipe.steps, 1):
        what = f"{runtime.label} step {number} ({step.describe()})"
        echo(f"{runtime.label}: resolving step {number}/{len(recipe.steps)} {step.describe()}")
        planned = PlannedStep(step.describe(), [])
        if isinstance(step, PipStep | RequirementsOfStep):
            args: list[str] = list(step.args) if isinstance(step, PipStep) else []
            if isinstance(step, RequirementsOfStep):
                planned.source = _single(pip_report(["--no-deps", step.requirement], target, what=what),
                                         step.requirement, what)  # fmt: skip
                metadata = "".join(f"Requires-Dist: {r}\n" for r in planned.source.requires_dist)
                selected = select_requirements(metadata, target.marker_environment(), step.exclude)
                args = [*selected.install, *step.also]
            found = pip_report(args, target, installed, what=what) if args else []
            new = [r for r in found if installed.get(r.canonical) != r.version]
            installed.update({r.canonical: r.version for r in found})
            planned.install = [r for r in new if r.canonical not in excluded_names | omitted_names]
            planned.excluded = sorted({r.canonical for r in new if r.canonical in excluded_names})
            planned.omitted = sorted({r.canonical for r in new if r.canonical in omitted_names})
        elif isinstance(step, ExtractStep):
            found = pip_report(["--no-deps", step.requirement], target, what=what)
            planned.source = _single(found, step.requirement, what)
        elif isinstance(step, UninstallStep):
            for name in step.names:
                installed.pop(canonicalize_name(name), None)
        elif isinstance(step, PluginStep):
            # Built on the target from its source: pip's isolated build needs the build backend offline too.
            requires = _build_requires(plugin_path(step.name))
            planned.build = pip_report(requires, target, what=what) if requires else []
        steps.append(planned)
    excluded = sorted({name for s in steps for name in s.excluded or []})
    omitted = sorted({name for s in steps for name in s.omitted or []})
    return PlannedRuntime(runtime.label, recipe.key(target.python, target.key_platform), steps, excluded, omitted)


def _build_requires(path: Path) -> list[str]:
    import tomllib

    document = tomllib.loads((path / "pyproject.toml").read_text())
    return [str(r) for r in document.get("build-system", {}).get("requires", [])]


def _size(value: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"


def _fetch(url: str, destination: Path) -> str:
    """Copy `url` (http, https or file) to `destination`; returns the sha256 of what was written."""
    digest = hashlib.sha256()
    parts = urllib.parse.urlsplit(url)
    try:
        if parts.scheme == "file":
            source = open(urllib.request.url2pathname(parts.path), "rb")  # noqa: SIM115 - closed below
        else:
            source = urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S)  # noqa: S310 - the index's URL
        with source, destination.open("wb") as out:
            while chunk := source.read(CHUNK):
                digest.update(chunk)
                out.write(chunk)
    except OSError as exc:
        destination.unlink(missing_ok=True)
        raise ConfigError(f"cannot download {url}: {exc}") from None
    return digest.hexdigest()


def download(files: Iterable[Resolved], directory: Path, echo: Echo) -> dict[str, LockedFile]:
    """Put every file into `directory` (kept when already there with the right sha256; every download is
    checked against the index's sha256); filename -> its `LockedFile`. One progress line per file."""
    unique = list({r.filename: r for r in files}.values())
    locked: dict[str, LockedFile] = {}
    fetched = fetched_bytes = 0
    started = time.monotonic()
    for number, item in enumerate(unique, 1):
        path = directory / item.filename
        sha256 = file_sha256(path) if path.is_file() else None
        if sha256 is not None and sha256 == (item.sha256 or sha256):
            how = "already there"
        else:
            part = directory / f".part-{item.filename}"
            file_started = time.monotonic()
            sha256 = _fetch(item.url, part)
            if item.sha256 is not None and sha256 != item.sha256:
                part.unlink(missing_ok=True)
                raise ConfigError(f"{item.url} does not match the index's sha256 ({sha256}, expected {item.sha256})"
                                  ": the download was corrupted or the file was replaced; try again")  # fmt: skip
            os.replace(part, path)
            fetched += 1
            fetched_bytes += path.stat().st_size
            how = f"downloaded in {time.monotonic() - file_started:.1f}s"
        size = path.stat().st_size
        locked[item.filename] = LockedFile(item.filename, item.name, item.version, sha256, size)
        echo(f"[{number}/{len(unique)}] {item.filename} ({_size(size)}) {how}")
    total = sum(f.size for f in locked.values())
    echo(f"{len(unique)} file(s), {_size(total)} in {directory}: {fetched} downloaded ({_size(fetched_bytes)}, "
         f"{time.monotonic() - started:.1f}s), {len(unique) - fetched} already there")  # fmt: skip
    return locked


def lock_of(planned: PlannedRuntime, files: Mapping[str, LockedFile]) -> RuntimeLock:
    """The manifest entry of a planned runtime once its files are in the wheelhouse."""
    steps = tuple(
        LockedStep(
            describe=s.describe,
            install=tuple(files[r.filename] for r in s.install),
            source=files[s.source.filename] if s.source else None,
            build=tuple(files[r.filename] for r in s.build or []),
            excluded=tuple(s.excluded or []),
            omitted=tuple(s.omitted or []),
        )
        for s in planned.steps
    )
    return RuntimeLock(planned.label, planned.key, steps, tuple(planned.excluded), tuple(planned.omitted))


def check_writable(directory: Path) -> None:
    """Create `directory` and make sure files can be written there (`ConfigError` naming it otherwise)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"--out {directory}: cannot write there ({exc.strerror or exc}); give a writable "
                          "directory") from None  # fmt: skip
