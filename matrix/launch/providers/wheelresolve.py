"""Make a wheelhouse: resolve every step of a venv recipe for a target host, then download its files.

Each step is resolved by ``uv pip compile`` for the target's interpreter and platform (``--python-version``,
``--python-platform``: uv evaluates the dependencies' markers for the target, not for the interpreter it
runs in), binary wheels only, with the pins of the earlier steps as constraints, the way the sequential
build would keep them, and the indexes of the user's pip configuration. uv writes its answer as a PEP 751
lock; of each package's wheels the one an installer on the target would take is kept. A step lists only
what it adds to the environment: a distribution an earlier step installed at the same version is not
installed again, as pip would not.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.parser import Parser
from functools import partial
from pathlib import Path
from typing import Any

from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError
from matrix.launch.providers.recipe import (
    ExtractStep,
    PipStep,
    PluginStep,
    RequirementsOfStep,
    UninstallStep,
    VenvRecipe,
    plugin_path,
    select_requirements,
    venv_recipe,
    wheel_metadata,
)
from matrix.launch.providers.venv.installer import find_uv, pip_settings, translate
from matrix.launch.providers.wheelhouse import (
    CHUNK,
    LockedFile,
    LockedStep,
    Manifest,
    RuntimeLock,
    file_sha256,
    read_manifest,
    write_manifest,
    write_pylock,
)
from matrix.launch.providers.wheeltarget import WheelTarget

Echo = Callable[[str], None]
RESOLVE_TIMEOUT_S = 900.0
DOWNLOAD_TIMEOUT_S = 60.0  # per read: a stalled server fails, a slow big download does not


@dataclass(frozen=True)
class Resolved:
    """One file of a resolution: the wheel a step installs or reads."""

    name: str
    version: str
    url: str
    sha256: str | None
    requires_dist: tuple[str, ...] = ()
    size: int | None = None  # bytes, as the lock gives it: what a wheelhouse will weigh, before any download

    @property
    def filename(self) -> str:
        return urllib.parse.unquote(urllib.parse.urlsplit(self.url).path.rsplit("/", 1)[-1])

    @property
    def canonical(self) -> str:
        return canonicalize_name(self.name)


def uv_platform(target: WheelTarget) -> str:
    """uv's `--python-platform` for the target: its newest manylinux (uv accepts every older tag with it),
    else its musl or plain Linux triple."""
    arch = target.arch
    glibc = [int(m.group(1)) for p in target.tags if (m := re.match(r"^manylinux_2_(\d+)_", p))]
    if glibc:
        return f"{arch}-manylinux_2_{max(glibc)}"
    if any(p.startswith("musllinux_") for p in target.tags):
        return f"{arch}-unknown-linux-musl"
    return f"{arch}-unknown-linux-gnu"


def _tag_ranks(target: WheelTarget) -> dict[Tag, int]:
    """The target's wheel tags, most preferred first, as an installer there ranks them."""
    version = tuple(int(part) for part in target.python.split("."))
    ordered = [*cpython_tags(version, [target.abi], target.tags),
               *compatible_tags(version, target.abi, target.tags)]  # fmt: skip
    return {tag: rank for rank, tag in reversed(list(enumerate(ordered)))}


def _best_wheel(package: Mapping[str, Any], ranks: Mapping[Tag, int], what: str) -> tuple[str, str | None, int | None]:
    """(url, sha256, size) of the wheel of a pylock package an installer on the target would take."""
    best: tuple[int, str, str | None, int | None] | None = None
    for wheel in package.get("wheels", []):
        location = str(wheel.get("url") or Path(str(wheel.get("path", ""))).resolve().as_uri())
        filename = str(wheel.get("name") or urllib.parse.unquote(location.rsplit("/", 1)[-1]))
        try:
            tags = parse_wheel_filename(filename)[3]
        except InvalidWheelFilename:
            continue
        rank = min((ranks[tag] for tag in tags if tag in ranks), default=None)
        if rank is not None and (best is None or rank < best[0]):
            size = wheel.get("size")
            best = (rank, location, wheel.get("hashes", {}).get("sha256"), size if isinstance(size, int) else None)
    if best is None:
        raise ConfigError(f"{what}: uv locked {package.get('name')} {package.get('version')}, but none of its "
                          "wheels fits the target")  # fmt: skip
    return best[1], best[2], best[3]


def _split_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """A recipe step's pip arguments as (uv options, requirements)."""
    options: list[str] = []
    requirements: list[str] = []
    taking_value = False
    for arg in args:
        if taking_value:
            options.append(arg)
            taking_value = False
        elif arg.startswith("-"):
            options.append(arg)
            taking_value = arg in _VALUE_OPTIONS
        else:
            requirements.append(arg)
    return options, requirements


_VALUE_OPTIONS = frozenset({"-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
                            "--only-binary", "--no-binary"})  # fmt: skip


def uv_report(
    args: Sequence[str], target: WheelTarget, constraints: Mapping[str, str] = {}, *, what: str = "",
    index_url: str | None = None,
) -> list[Resolved]:
    """What `pip install ARGS` would install on `target`, resolved by `uv pip compile` for the target's
    interpreter and platform (its markers too), with the pip configuration's indexes (or only `index_url`);
    `ConfigError` when it cannot be resolved."""
    uv = find_uv()
    if uv is None:
        raise ConfigError(f"{what}: locking needs uv (pip install uv)")
    options, requirements = _split_args(args)
    index_args, index_env, refused = translate(pip_settings()) if index_url is None else (
        ["--index-url", index_url], {}, [])  # fmt: skip
    if refused:
        first = refused[0]
        raise ConfigError(f"{what}: pip setting {first.name} = {first.value} ({first.origin}) has no uv equivalent; "
                          "lock on a host without it")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="matrix-resolve-") as tmp:
        (Path(tmp) / "requirements.in").write_text("".join(f"{r}\n" for r in requirements))
        # uv needs an interpreter only to build source distributions (none here: binary only). Left to find
        # one, for a target Python the host lacks it first tries to download it, on every call: 12-25 s of
        # retries on a host whose network does not reach the download mirror.
        argv = [
            uv, "pip", "compile", "--quiet", "--no-header", "--format", "pylock.toml", "--output-file",
            str(Path(tmp) / "pylock.toml"), "--python", sys.executable, "--no-python-downloads",
            "--python-version", target.python, "--python-platform",
            uv_platform(target), "--only-binary", ":all:", *index_args, *options,
        ]  # fmt: skip
        if constraints:
            pins = Path(tmp) / "constraints.txt"
            pins.write_text("".join(f"{name}=={version}\n" for name, version in sorted(constraints.items())))
            argv += ["--constraint", str(pins)]
        env = {**os.environ, **index_env}
        env.pop("PYTHONPATH", None)
        try:
            done = subprocess.run([*argv, str(Path(tmp) / "requirements.in")], capture_output=True, text=True,
                                  env=env, timeout=RESOLVE_TIMEOUT_S, check=False,
                                  stdin=subprocess.DEVNULL)  # fmt: skip
        except subprocess.TimeoutExpired:
            raise ConfigError(f"{what}: uv did not resolve within {RESOLVE_TIMEOUT_S:.0f} s") from None
        if done.returncode != 0:
            lines = [line for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
            raise ConfigError(
                f"{what}: uv could not resolve it for Python {target.python} on {uv_platform(target)} (binary "
                "wheels only; pick a version that has one, or --exclude what the target host provides):\n"
                + "\n".join(lines[-15:])
            )
        document = tomllib.loads((Path(tmp) / "pylock.toml").read_text())
    ranks = _tag_ranks(target)
    found = []
    for package in document.get("packages", []):
        url, sha256, size = _best_wheel(package, ranks, what)
        found.append(Resolved(str(package["name"]), str(package["version"]), url, sha256, size=size))
    return found


# uv's words for a requirement no index has ("Because there is no version of nixl-cu12==1.5.2 and nixl==1.5.2
# depends on nixl-cu12==1.5.2, ..."; "Because nixl-cu12 was not found in the package registry and ...").
_NO_VERSION = re.compile(r"there is no version of ([^\s,]+)")
_NOT_FOUND = re.compile(r"\b([A-Za-z0-9][\w.-]*) was not found in the (?:package registry|provided package locations)")
# "Because only certifi<=2026.10.19.post1 is available and ai-dynamo==1.7.0.dev20261026 depends on
# certifi>=2026.10.23, ..." (or "... and you require certifi>=2026.10.23"): the index has the project, but no
# version the requirement accepts (the ai-dynamo nightlies of 2026-10-25/26 on PyPI).
_ONLY_OLDER = re.compile(r"only [A-Za-z0-9][\w.-]*\s*[<>=!~]=?\s*\S+ (?:is|are) available and "
                         r"(?:\S+ depends? on|you require) ([^\s,]+)")


@dataclass(frozen=True)
class Resolvability:
    """Whether requirements resolve for a target: `missing` names what no index has (uv's words); `unchecked`
    says why nothing could be said (uv missing, the index unreachable or broken): then the build decides."""

    missing: tuple[str, ...] = ()
    unchecked: str = ""


def resolvability(
    requirement_sets: Sequence[Sequence[str]], target: WheelTarget, *, index_url: str | None = None
) -> Resolvability:
    """Resolve each set of pip arguments (a recipe step's: `--no-deps` kept) for `target` with uv, without
    installing or downloading anything but metadata; the first set that names missing requirements answers."""
    for args in requirement_sets:
        try:
            uv_report(args, target, what="check", index_url=index_url)
        except ConfigError as exc:
            missing = missing_in(str(exc))
            if not missing:
                return Resolvability(unchecked=str(exc).splitlines()[-1] if str(exc) else "uv failed")
            return Resolvability(missing=missing)
    return Resolvability()


def refuse_unresolvable(runtimes: Iterable[RuntimeInfo]) -> None:
    """A `ConfigError` (one line) for the first `venv` runtime whose recipe's steps name what no index has for
    its own target (uv, metadata only, one resolution per step); other providers and an index uv cannot ask
    pass (the build decides then)."""
    for runtime in runtimes:
        target = own_target(runtime.provider)
        if target is None:
            continue
        found = resolvability(step_requirements(runtime.provider.get("steps", [])), target)
        if found.missing:
            raise ConfigError(
                f"runtime {runtime.label} cannot be built: no index has {', '.join(found.missing)} for Python "
                f"{target.python} on {target.platforms[0]} (uv's resolver); fix its recipe's pins or leave it out"
            )


def missing_in(text: str) -> tuple[str, ...]:
    """The requirements uv's failure says no index has, in its order (empty: it failed for another reason)."""
    # uv wraps its explanation to the terminal's width (COLUMNS: under pytest-xdist a clause ran over two
    # lines), so the words are read with their line breaks and indents folded to single spaces.
    text = " ".join(text.split())
    found = [*_NO_VERSION.findall(text), *_NOT_FOUND.findall(text), *_ONLY_OLDER.findall(text)]
    return tuple(dict.fromkeys(m.rstrip(".") for m in found))


def step_requirements(steps: Sequence[Any]) -> list[list[str]]:
    """The pip arguments that name what a provider's raw `steps` install or read: a pip step's own arguments,
    the requirement of a `requirements_of` (its own wheel, with its `with`) or of an `extract` (no deps)."""
    found: list[list[str]] = []
    for step in steps:
        if isinstance(step, list) and step:
            found.append([str(a) for a in step])
        elif isinstance(step, dict) and isinstance(step.get("requirements_of"), str):
            found.append(["--no-deps", step["requirements_of"], *[str(w) for w in step.get("with", [])]])
        elif isinstance(step, dict) and isinstance(step.get("extract"), str):
            found.append(["--no-deps", step["extract"]])
    return found


def own_target(provider: Mapping[str, Any]) -> WheelTarget | None:
    """The target a `venv` runtime builds for: its recipe's Python (this interpreter's when it names none or
    names a path) on this host's platform; None for other providers (nothing is resolved for them here)."""
    from matrix.launch.providers.wheeltarget import this_host

    if provider.get("kind") != "venv":
        return None
    try:
        host = this_host()
    except ConfigError:
        return None  # not Linux: no runtime of this host is resolved here
    python = str(provider.get("python") or "")
    line = ".".join(python.split(".")[:2])
    return WheelTarget.of(line if re.fullmatch(r"3\.\d+", line) else host.python, host.platforms)


def requires_dist(resolved: Resolved) -> tuple[str, ...]:
    """The Requires-Dist of a resolved wheel: from the index's metadata file (PEP 658) when it serves one,
    else from the wheel itself, downloaded to a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="matrix-metadata-") as tmp:
        metadata = Path(tmp) / "METADATA"
        try:
            _fetch(resolved.url + ".metadata", metadata)
            text = metadata.read_text(encoding="utf-8")
        except ConfigError:
            wheel = Path(tmp) / resolved.filename
            _fetch(resolved.url, wheel)
            text = wheel_metadata(wheel)
    return tuple(str(line) for line in Parser().parsestr(text).get_all("Requires-Dist") or [])


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
    # What the environment holds at the end (installed by a step, not uninstalled by a later one), by name.
    final: dict[str, Resolved] = field(default_factory=dict)


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


# Resolutions of one runtime run at once at most (independent ones: `_Prefetch`); each is one uv process.
PREFETCH_WORKERS = 4


class _Prefetch:
    """The resolutions of one recipe that do not depend on the steps before them, started at once.

    A `--no-deps` resolution (an `extract` or `requirements_of` source, a `--no-deps` pip step) and a
    plugin's build requirements depend on no earlier step, except through a constraint on one of the very
    names it resolves: such a result is used only when the earlier steps pin none of its names at another
    version (then the constrained resolution would give the same files), else that step is resolved again
    in order. So the lock is the sequential one, its independent uv processes overlapping."""

    def __init__(self, pool: ThreadPoolExecutor | None) -> None:
        self.pool = pool
        self.futures: dict[tuple[str, ...], Future[Any]] = {}

    def submit(self, key: tuple[str, ...], call: Callable[[], Any]) -> None:
        if self.pool is not None and key not in self.futures:
            self.futures[key] = self.pool.submit(call)

    def get(self, key: tuple[str, ...], call: Callable[[], Any]) -> Any:
        future = self.futures.pop(key, None)
        return future.result() if future is not None else call()

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()


def _no_deps_step(step: object) -> bool:
    return isinstance(step, PipStep) and "--no-deps" in step.args


def plan_runtime(
    runtime: RuntimeInfo,
    target: WheelTarget,
    exclude: Iterable[str],
    echo: Echo,
    omit: Iterable[str] = (),
    *,
    workers: int = PREFETCH_WORKERS,
) -> PlannedRuntime:
    """Resolve every step of the runtime's recipe for `target`; `exclude` names what the host provides,
    `omit` what the runtime never imports there (both are left out of the wheelhouse). `workers`: how many
    uv resolutions run at once (1: one after the other, step by step; the result is the same)."""
    recipe = venv_recipe(runtime)
    check_recipe_python(recipe, target, runtime.label)
    excluded_names = {canonicalize_name(n) for n in exclude}
    omitted_names = {canonicalize_name(n) for n in omit} - excluded_names
    installed: dict[str, str] = {}  # canonical name -> version, as the sequential build would have it
    final: dict[str, Resolved] = {}
    steps: list[PlannedStep] = []
    find_uv()  # before any thread: sysconfig's first read (in uv's find_uv_bin) is not thread-safe
    pool = ThreadPoolExecutor(workers, thread_name_prefix="matrix-resolve") if workers > 1 else None
    early = _Prefetch(pool)

    def source_of(requirement: str, what: str) -> Resolved:
        return _single(uv_report(["--no-deps", requirement], target, what=what), requirement, what)

    def with_metadata(requirement: str, what: str) -> tuple[Resolved, tuple[str, ...]]:
        source = source_of(requirement, what)
        return source, requires_dist(source)

    for number, step in enumerate(recipe.steps, 1):
        what = f"{runtime.label} step {number} ({step.describe()})"
        if isinstance(step, RequirementsOfStep):
            early.submit(("metadata", step.requirement), partial(with_metadata, step.requirement, what))
        elif isinstance(step, ExtractStep):
            early.submit(("source", step.requirement), partial(source_of, step.requirement, what))
        elif _no_deps_step(step):
            assert isinstance(step, PipStep)
            early.submit(("pip", *step.args), partial(uv_report, step.args, target, what=what))
        elif isinstance(step, PluginStep):
            requires = _build_requires(plugin_path(step.name))
            if requires:
                early.submit(("build", step.name), partial(uv_report, requires, target, what=what))
    try:
        for number, step in enumerate(recipe.steps, 1):
            what = f"{runtime.label} step {number} ({step.describe()})"
            echo(f"{runtime.label}: resolving step {number}/{len(recipe.steps)} {step.describe()}")
            planned = PlannedStep(step.describe(), [])
            if isinstance(step, PipStep | RequirementsOfStep):
                args: list[str] = list(step.args) if isinstance(step, PipStep) else []
                if isinstance(step, RequirementsOfStep):
                    planned.source, requires = early.get(
                        ("metadata", step.requirement), partial(with_metadata, step.requirement, what)
                    )
                    metadata = "".join(f"Requires-Dist: {r}\n" for r in requires)
                    selected = select_requirements(metadata, target.marker_environment(), step.exclude)
                    args = [*selected.install, *step.also]
                found: list[Resolved] = []
                if _no_deps_step(step):
                    found = early.get(("pip", *args), list)
                    if not found or any(installed.get(r.canonical, r.version) != r.version for r in found):
                        found = uv_report(args, target, installed, what=what)  # an earlier pin applies
                elif args:
                    found = uv_report(args, target, installed, what=what)
                new = [r for r in found if installed.get(r.canonical) != r.version]
                installed.update({r.canonical: r.version for r in found})
                planned.install = [r for r in new if r.canonical not in excluded_names | omitted_names]
                planned.excluded = sorted({r.canonical for r in new if r.canonical in excluded_names})
                planned.omitted = sorted({r.canonical for r in new if r.canonical in omitted_names})
                final.update({r.canonical: r for r in planned.install})
            elif isinstance(step, ExtractStep):
                planned.source = early.get(("source", step.requirement), partial(source_of, step.requirement, what))
            elif isinstance(step, UninstallStep):
                for name in step.names:
                    installed.pop(canonicalize_name(name), None)
                    final.pop(canonicalize_name(name), None)
            elif isinstance(step, PluginStep):
                # Built on the target from its source: pip's isolated build needs the build backend offline too.
                requires = _build_requires(plugin_path(step.name))
                planned.build = (
                    early.get(("build", step.name), partial(uv_report, requires, target, what=what)) if requires else []
                )
            steps.append(planned)
    finally:
        early.close()
        if pool is not None:
            pool.shutdown(wait=True)
    excluded = sorted({name for s in steps for name in s.excluded or []})
    omitted = sorted({name for s in steps for name in s.omitted or []})
    key = recipe.key(target.python, target.key_platform)
    return PlannedRuntime(runtime.label, key, steps, excluded, omitted, final)


def plan_runtimes(
    runtimes: Sequence[RuntimeInfo],
    target: WheelTarget,
    exclude: Iterable[str],
    echo: Echo,
    omit: Iterable[str] = (),
    *,
    workers: int = PREFETCH_WORKERS,
) -> list[PlannedRuntime]:
    """`plan_runtime` of each runtime, all at once (each runtime's lock depends on its own steps only), in
    the order given; `workers=1`: one runtime after the other, each step by step."""
    exclude, omit = list(exclude), list(omit)
    find_uv()  # as in plan_runtime
    if workers <= 1 or len(runtimes) <= 1:
        return [plan_runtime(r, target, exclude, echo, omit, workers=workers) for r in runtimes]
    with ThreadPoolExecutor(len(runtimes), thread_name_prefix="matrix-lock") as pool:
        futures = [pool.submit(plan_runtime, r, target, exclude, echo, omit, workers=workers) for r in runtimes]
        return [future.result() for future in futures]


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


def wheelhouse_command_line(
    selection: Mapping[str, Sequence[str]], target: WheelTarget, out: Path, exclude: Sequence[str], omit: Sequence[str]
) -> str:
    """The `matrix runtime wheelhouse` command that makes this wheelhouse, every option spelled out (recorded
    in the manifest, so the upload can be rebuilt from it alone)."""
    argv = ["matrix", "runtime", "wheelhouse"]
    for option in ("runtime", "backend", "since", "until"):
        for value in selection.get(option, ()):
            argv += [f"--{option}", value]
    argv += ["--python", target.python, *(a for p in target.platforms for a in ("--platform", p)), "--out", str(out)]
    argv += [a for name in exclude for a in ("--exclude", name)]
    argv += [a for name in omit for a in ("--omit", name)]
    return shlex.join(argv)


def make_wheelhouse(
    runtimes: Sequence[RuntimeInfo],
    target: WheelTarget,
    out: Path,
    *,
    exclude: Sequence[str] = (),
    omit: Sequence[str] = (),
    command: str = "",
    echo: Echo,
) -> tuple[Path, Manifest, dict[str, RuntimeLock]]:
    """Lock `runtimes` for `target`, download their files into `out`, write (or extend) the manifest with the
    command that made it and a PEP 751 `pylock.<runtime>.toml` per runtime; (manifest path, the manifest,
    the new locks by label). `ConfigError` for another target in `out`, before anything is resolved."""
    check_writable(out)
    created = datetime.now(UTC).isoformat(timespec="seconds")
    fresh = Manifest(target.python, target.platforms, target.key_platform, created)
    existing = read_manifest(out)
    if existing is not None:
        existing.merged(fresh)  # refuses another target before anything is resolved or downloaded
    echo(f"wheelhouse for {target.describe()} ({len(target.tags)} platform tags) in {out}")
    try:
        planned = plan_runtimes(runtimes, target, exclude, echo, omit)
    except ConfigError as exc:
        missing = missing_in(str(exc))
        if not missing:
            raise
        # An unresolvable runtime: one line naming what is missing, before anything is downloaded.
        who = str(exc).split(": uv could not resolve", 1)[0]
        raise ConfigError(f"{who}: no index has {', '.join(missing)} for {target.describe()} (uv's resolver); "
                          "nothing was downloaded: pin versions that exist in the runtime's recipe") from None
    files = download([f for p in planned for s in p.steps for f in s.downloads()], out, echo)
    locks = {p.label: lock_of(p, files) for p in planned}
    manifest = Manifest(target.python, target.platforms, target.key_platform, created, locks,
                        (command,) if command else ())  # fmt: skip
    if existing is not None:
        manifest = existing.merged(manifest)
    for plan in planned:
        write_pylock(out, plan.label, target, [files[r.filename] for r in plan.final.values()],
                     locks[plan.label].excluded, locks[plan.label].omitted)  # fmt: skip
    return write_manifest(out, manifest), manifest, locks
